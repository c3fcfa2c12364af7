"""Tail drafting on real vLLM CPU replicas: rollout makespan with ROLLOUT_EXT_TAIL_DRAFTING=1 against without.

The DAPO rollout shape: `--replicas` rollout_ext replicas (verl's LLMServerManager) of the trained
arithmetic model, `--prompts` held-out problems x `--samples` samples at temperature 1, a seed per
sample, all sent at once through rollout_ext's router (TailAwareRouter, `--policy`) and chunked
client, as bench/balance_real.py does. Drafting is an engine setting, so each arm starts its own
replicas: per repeat, the arms run in turn (order alternating between repeats), each on fresh
replicas after a warm-up batch. The arm `off` runs twice per repeat (`off` and `off_again`): the
spread of off_again / off is the noise floor of the paired ratio.

Phases: the full-batch phase ends when at most replicas x ROLLOUT_EXT_TAIL_BATCH_SEQS sequences
still run (drafting is off above that on each replica); its time is read from the finish times.
Requests carry no seed: drafting keeps the sampled distribution but not the random stream, so no
two arms could decode the same samples anyway (and vLLM 0.27.1's CPU runner fails a seeded request
whose prefill is split across steps: "CPU Generator does not use offset"). Each run samples its
own batch from the same distribution; lengths are reported, and off_again shows the spread.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python bench/drafting_real.py --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import balance_real  # noqa: E402

# arm -> the replicas' switches
ARMS = {
    "off": {"ROLLOUT_EXT_TAIL_DRAFTING": "0"},
    "tail": {"ROLLOUT_EXT_TAIL_DRAFTING": "1"},
    "off_again": {"ROLLOUT_EXT_TAIL_DRAFTING": "0"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=16, help="responses per prompt (DAPO's n)")
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128, help="per replica")
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--policy", default="tail_aware")
    p.add_argument("--draft-tokens", type=int, default=8, help="ROLLOUT_EXT_DRAFT_TOKENS")
    p.add_argument("--tail-batch-seqs", type=int, default=16, help="ROLLOUT_EXT_TAIL_BATCH_SEQS")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: each repeat's makespan over off's, per arm")
    p.add_argument("--replot", default=None, metavar="JSON", help="draw --plot from an earlier --json")
    a = p.parse_args(argv)
    for name in ("replicas", "prompts", "samples", "cap", "max_num_seqs", "chunk_tokens", "draft_tokens",
                 "tail_batch_seqs", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}; allowed: >= 1")
    if a.prompts < balance_real.ARITH_OPERAND_COUNTS:
        p.error(f"--prompts={a.prompts}; allowed: at least {balance_real.ARITH_OPERAND_COUNTS} (one per operand count)")
    if a.replot and not a.plot:
        p.error(f"--replot={a.replot}: also give --plot PATH")
    return a


def _balance_args(a):
    return balance_real.parse_args(["--workload", "arith", "--replicas", str(a.replicas), "--prompts", str(a.prompts),
                                    "--samples", str(a.samples), "--cap", str(a.cap), "--max-num-seqs",
                                    str(a.max_num_seqs), "--chunk-tokens", str(a.chunk_tokens), "--seed", str(a.seed)])


def full_batch_s(finish_s: list[float], running_limit: int) -> float:
    """When at most `running_limit` sequences still run: the finish of the (N - limit)-th."""
    done = sorted(finish_s)
    return done[len(done) - running_limit - 1] if len(done) > running_limit else 0.0


def jobs(b, epoch: int) -> list[dict]:
    return [{**job, "seed": None} for job in balance_real.make_jobs(b, epoch=epoch)]


def run_arm(a, arm: str, tmp: Path) -> dict:
    import ray

    b = _balance_args(a)
    env = {**ARMS[arm], "ROLLOUT_EXT_DRAFT_TOKENS": str(a.draft_tokens),
           "ROLLOUT_EXT_TAIL_BATCH_SEQS": str(a.tail_batch_seqs)}
    started = time.perf_counter()
    # Replicas take their rollout_ext switches from the driver's environment (server_env_vars), as
    # in a verl job: this arm's switches go there while its replicas start.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        config, manager = balance_real.start_replicas(b)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        def client():
            return balance_real.make_client(config, balance_real.make_router(manager, a.policy, a.chunk_tokens,
                                                                             a.max_num_seqs, tmp))

        # Warm the engines (first steps compile and allocate), then the measured batch on a fresh router.
        asyncio.run(balance_real.rollout(client(), jobs(b, epoch=-99)[: 4 * a.replicas], a.cap))
        before = balance_real.spec_decode_counts(manager)
        run = asyncio.run(balance_real.rollout(client(), jobs(b, epoch=0), a.cap))
        after = balance_real.spec_decode_counts(manager)
    finally:
        ray.shutdown()
    lengths = [len(o.token_ids) for o in run["outputs"]]
    finish = list(run["finish_s"].values())
    spec = {k: after[k] - before[k] for k in after}
    return {"arm": arm, "makespan_s": round(run["makespan_s"], 3),
            "full_batch_s": round(full_batch_s(finish, a.replicas * a.tail_batch_seqs), 3),
            "tokens": int(sum(lengths)), "length_mean": round(float(np.mean(lengths)), 1), "length_max": max(lengths),
            "spec_decode": spec, "start_and_run_s": round(time.perf_counter() - started, 1)}


def run(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="drafting_real-"))
    arms = list(ARMS)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for rep in range(a.repeats):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            row = run_arm(a, arm, tmp)
            runs[arm].append(row)
            print(f"repeat {rep + 1}/{a.repeats} {arm}: makespan {row['makespan_s']:.2f} s, full batch "
                  f"{row['full_batch_s']:.2f} s, {row['tokens']} tokens, spec {row['spec_decode']}", flush=True)
    base = runs["off"]
    results = []
    for arm in arms:
        rows = runs[arm]
        row = {"arm": arm, "switches": ARMS[arm], "runs": rows}
        for key in ("makespan_s", "full_batch_s"):
            ratios = sorted(r[key] / b[key] for r, b in zip(rows, base) if b[key] > 0)
            row[f"{key}_median"] = round(float(np.median([r[key] for r in rows])), 3)
            row[f"{key}_paired_ratio_median"] = round(float(np.median(ratios)), 3) if ratios else None
            row[f"{key}_paired_ratio_range"] = [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else None
        results.append(row)
    return {"setup": {"model": str(balance_real.WORKLOADS["arith"][0]), "replicas": a.replicas, "prompts": a.prompts,
                      "samples": a.samples, "cap": a.cap, "max_num_seqs": a.max_num_seqs,
                      "chunk_tokens": a.chunk_tokens, "policy": a.policy, "draft_tokens": a.draft_tokens,
                      "tail_batch_seqs": a.tail_batch_seqs, "repeats": a.repeats, "seed": a.seed,
                      "machine": {"python": platform.python_version(),
                                  "processor": platform.processor() or platform.machine(),
                                  "cpus": balance_real._cpus()}},
            "results": results}


def report(out: dict) -> None:
    print(json.dumps(out["setup"], indent=1))
    print(f"{'arm':<10} {'makespan_s':>10} {'vs off (paired, range)':>26} {'full_batch_s':>12} "
          f"{'vs off (paired, range)':>26} {'accepted/drafted':>18}")
    for r in out["results"]:
        spec = [x["spec_decode"] for x in r["runs"]]
        accepted, drafted = sum(s["accepted_tokens"] for s in spec), sum(s["draft_tokens"] for s in spec)

        def paired(key):
            low, high = r[f"{key}_paired_ratio_range"] or (0, 0)
            return f"{r[f'{key}_paired_ratio_median'] or 0:.3f} ({low:.3f}-{high:.3f})"

        print(f"{r['arm']:<10} {r['makespan_s_median']:>10.2f} {paired('makespan_s'):>26} {r['full_batch_s_median']:>12.2f} "
              f"{paired('full_batch_s'):>26} {f'{accepted}/{drafted}':>18}")


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["results"] if r["arm"] != "off"]
    base = next(r for r in out["results"] if r["arm"] == "off")
    fig, axes = plt.subplots(1, 2, figsize=(8, 4), sharey=True)
    for ax, key, title in zip(axes, ("makespan_s", "full_batch_s"), ("rollout makespan", "full-batch phase")):
        for x, r in enumerate(rows):
            ratios = [v[key] / b[key] for v, b in zip(r["runs"], base["runs"]) if b[key] > 0]
            color = "tab:gray" if r["arm"] == "off_again" else "tab:blue"
            ax.bar(x, float(np.median(ratios)), width=0.6, color=color, alpha=0.35)
            ax.scatter([x] * len(ratios), ratios, color=color, zorder=3, s=18)
            ax.annotate(f"{np.median(ratios):.3f}", (x, max(ratios)), xytext=(0, 4), textcoords="offset points",
                        ha="center", fontsize=9)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", zorder=0)
        ax.set_xticks(range(len(rows)), [r["arm"] + ("\n(noise floor)" if r["arm"] == "off_again" else "")
                                         for r in rows])
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("over drafting off, same repeat")
    s = out["setup"]
    fig.suptitle(f"{s['replicas']} real vLLM CPU replicas, {s['prompts']}x{s['samples']} arith, {s['repeats']} repeats, "
                 f"K={s['draft_tokens']} at <= {s['tail_batch_seqs']} running", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    a = parse_args(argv)
    out = json.loads(Path(a.replot).read_text()) if a.replot else run(a)
    if not a.replot:
        report(out)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        plot(out, a.plot)
        print("plot:", a.plot)
    return out


if __name__ == "__main__":
    main()
