"""How well the length predictor (rollout_ext.balance.predictor) predicts at dispatch: the trained
arithmetic model's natural lengths against the synthetic workload the simulator uses.

Each workload runs as epochs of the same prompts: every request of an epoch is predicted at dispatch
(no sibling has finished yet, so only the prompt length and earlier epochs inform it), then every
true length is observed, then `end_epoch()`. The first epoch is the prior alone; the last one has
`--epochs - 1` epochs of history. Reported per epoch: the mean |log(predicted / true)|, the mean
log bias (> 0 over-predicts), and the floor no per-prompt predictor can beat: the error of
predicting each length by its own group's geometric mean (the within-group spread).

Arith lengths come from `python -m rollout_ext.testing.arith_props --seed S --json PATH`, one run per
epoch (the same held-out prompts, fresh samples):
    for s in 0 1 2; do python -m rollout_ext.testing.arith_props --seed $s --json out/arith_$s.json; done
    python bench/predictor_error.py --arith-json out/arith_0.json,out/arith_1.json,out/arith_2.json \
        --json out/predictor_error.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rollout_ext.balance.predictor import LengthPredictor  # noqa: E402
from rollout_ext.balance.request import Request  # noqa: E402
from rollout_ext.balance.workload import WorkloadConfig, make_workload  # noqa: E402


def epoch_error(predictor: LengthPredictor, requests: list[Request], lengths: list[int]) -> dict:
    """Predict every request at dispatch, then observe every true length and end the epoch."""
    predicted = [predictor.remaining_tokens(r, 0) for r in requests]
    for request, length, guess in zip(requests, lengths, predicted):
        predictor.observe(request, length, True, predicted_tokens=guess)
    predictor.end_epoch()
    errors = [math.log(max(1.0, p) / max(1, n)) for p, n in zip(predicted, lengths)]
    by_group: dict[str, list[float]] = {}
    for request, length in zip(requests, lengths):
        by_group.setdefault(request.group_key, []).append(math.log(max(1, length)))
    floor = [abs(math.log(max(1, n)) - statistics.fmean(by_group[r.group_key])) for r, n in zip(requests, lengths)]
    return {"mean_abs_log_error": round(statistics.fmean(abs(e) for e in errors), 3),
            "mean_log_bias": round(statistics.fmean(errors), 3),
            "group_mean_floor": round(statistics.fmean(floor), 3),
            "requests": len(requests)}


def synthetic_epochs(prompts: int, samples: int, epochs: int, seed: int) -> list[tuple[list[Request], list[int]]]:
    config = WorkloadConfig(prompts=prompts, samples=samples, seed=seed)
    out = []
    for epoch in range(-(epochs - 1), 1):
        w = make_workload(config, epoch=epoch)
        requests = [Request(f"{w.request_ids[i]}@{epoch}", f"{w.group_keys[i]}@{epoch}", int(w.sample_index[i]),
                            int(w.prompt_tokens[i]), config.cap_tokens, w.prompt_hashes[i]) for i in range(len(w))]
        out.append((requests, [int(x) for x in w.lengths]))
    return out


def arith_epochs(paths: list[Path]) -> list[tuple[list[Request], list[int]]]:
    from rollout_ext.testing.arith_props import held_out_problems

    out = []
    for epoch, path in enumerate(paths):
        run = json.loads(path.read_text())
        setup = run["setup"]
        problems = held_out_problems(setup["prompts"])
        requests, lengths = [], []
        for p, (problem, group) in enumerate(zip(problems, run["lengths"], strict=True)):
            prompt_hash = hashlib.blake2b(problem.prompt.encode(), digest_size=8).hexdigest()
            for s, length in enumerate(group):
                requests.append(Request(f"{epoch}-{p}-{s}", f"{epoch}-{p}", s, len(problem.prompt),
                                        setup["max_tokens"], prompt_hash))
                lengths.append(length)
        out.append((requests, lengths))
    return out


def run(epochs_by_workload: dict[str, list]) -> dict:
    results = {}
    for name, epochs in epochs_by_workload.items():
        predictor = LengthPredictor()
        results[name] = [epoch_error(predictor, requests, lengths) for requests, lengths in epochs]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arith-json", required=True,
                   help="comma list of arith_props JSONs, one per epoch, oldest first (same --prompts)")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    paths = [Path(x) for x in a.arith_json.split(",") if x]
    missing = [str(x) for x in paths if not x.is_file()]
    if missing:
        p.error(f"--arith-json: no such file {', '.join(missing)}")
    if len(paths) < 2:
        p.error(f"--arith-json names {len(paths)} file(s); allowed: 2 or more (the last epoch needs history)")
    arith = arith_epochs(paths)
    first = json.loads(paths[0].read_text())["setup"]
    synthetic = synthetic_epochs(first["prompts"], first["samples"], len(paths), a.seed)
    results = run({"arith": arith, "synthetic": synthetic})
    print(f"{'workload':<10} {'epoch':>5} {'history':>7} {'|log err|':>9} {'bias':>7} {'group floor':>11}")
    for name, rows in results.items():
        for i, row in enumerate(rows):
            print(f"{name:<10} {i:>5} {i:>7} {row['mean_abs_log_error']:>9.3f} {row['mean_log_bias']:>7.3f} "
                  f"{row['group_mean_floor']:>11.3f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"arith_json": [str(x) for x in paths], "seed": a.seed, "results": results},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
