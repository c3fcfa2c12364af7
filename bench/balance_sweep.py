"""Robustness sweep of the balancing acceptance over unseen workloads (simulator only).

For every R in --replicas, ICC in --iccs and cap in --caps (one workload per cell; the seed
differs per cell so several seeds are covered), it runs round_robin, verl_default,
tail_aware_placement and tail_aware and checks the acceptance rule:

    tail_aware < round_robin - margin,  tail_aware < verl_default - margin,
    tail_aware <= tail_aware_placement + 1e-9

`margin` (--margin, ratio units) is what "clearly lower, not noise" means here. It prints a
compact pass/fail grid (one line per cell with the four ratios) and writes all rows to JSON.
The predictor is warmed with one previous epoch, as in bench/rollout_balance.py.

Example (about 10-20 min on 2 busy cores):
  python bench/balance_sweep.py --prompts 128 --samples 16 --json /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_balance import make_policy  # noqa: E402

from rollout_ext.balance.simulator import simulate  # noqa: E402
from rollout_ext.balance.step_model import StepModel, lower_bound_s  # noqa: E402
from rollout_ext.balance.workload import WorkloadConfig, make_workload  # noqa: E402

CHECKED = ["round_robin", "verl_default", "tail_aware_placement", "tail_aware"]


def _list(flag: str, text: str, kind, ok, allowed: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag}={text!r} is not a comma-separated list; allowed: {allowed}")
    if not values or not all(ok(v) for v in values):
        raise SystemExit(f"error: {flag}={text!r}; allowed: {allowed}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="4,8,16,32,64,128")
    p.add_argument("--iccs", default="0.3,0.6,0.85")
    p.add_argument("--caps", default="8192,20480,32768")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--mean-len", type=float, default=3500.0)
    p.add_argument("--seed", type=int, default=0, help="base seed; cell i uses seed + i")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--margin", type=float, default=0.005, help="required ratio gap to the baselines")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.replica_list = _list("--replicas", a.replicas, int, lambda v: v >= 1, "integers >= 1")
    a.icc_list = _list("--iccs", a.iccs, float, lambda v: 0 <= v <= 1, "numbers in [0, 1]")
    a.cap_list = _list("--caps", a.caps, int, lambda v: v > a.mean_len, f"integers > --mean-len ({a.mean_len})")
    if a.prompts < 1 or a.samples < 1:
        raise SystemExit(f"error: --prompts={a.prompts} / --samples={a.samples}; allowed: integers >= 1")
    if a.chunk_tokens < 1:
        raise SystemExit(f"error: --chunk-tokens={a.chunk_tokens}; allowed: integer >= 1")
    return a


def check(ratios: dict, margin: float) -> bool:
    ta = ratios["tail_aware"]
    return (ta < ratios["round_robin"] - margin and ta < ratios["verl_default"] - margin
            and ta <= ratios["tail_aware_placement"] + 1e-9)


def summarize(rows: list[dict]) -> dict:
    """Per R: geometric-mean ratio of tail_aware to each other policy, and how often it is lower.

    One cell is one workload, so single cells are noisy (a different seed moves a ratio by a
    few percent); the paired mean over cells is the steadier view."""
    out = {}
    for replicas in sorted({r["replicas"] for r in rows}):
        cells = [r["ratios"] for r in rows if r["replicas"] == replicas]
        entry = {"cells": len(cells)}
        for other in CHECKED[:-1]:
            logs = [math.log(c["tail_aware"] / c[other]) for c in cells]
            entry[other] = {"geo_mean": round(math.exp(sum(logs) / len(logs)), 4),
                            "lower": sum(c["tail_aware"] < c[other] for c in cells),
                            "not_higher": sum(c["tail_aware"] <= c[other] + 1e-9 for c in cells)}
        out[str(replicas)] = entry
    return out


def summary_lines(summary: dict) -> list[str]:
    lines = [f"{'R':>4} {'cells':>5}  " + "  ".join(f"{'vs ' + n:>28}" for n in CHECKED[:-1])]
    for replicas, entry in summary.items():
        parts = []
        for other in CHECKED[:-1]:
            e = entry[other]
            count = e["not_higher"] if other == "tail_aware_placement" else e["lower"]
            rel = "<=" if other == "tail_aware_placement" else "<"
            parts.append(f"{e['geo_mean']:>8.3f} ({rel} in {count}/{entry['cells']})".rjust(28))
        lines.append(f"{replicas:>4} {entry['cells']:>5}  " + "  ".join(parts))
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    model = StepModel()
    cells = [(r, icc, cap) for r in a.replica_list for icc in a.icc_list for cap in a.cap_list]
    rows, started = [], time.perf_counter()
    print(f"{a.prompts}x{a.samples} prompts, mean {a.mean_len:.0f}, chunk {a.chunk_tokens}, margin {a.margin}")
    print(f"{'R':>4} {'icc':>5} {'cap':>6} {'seed':>4}  " + " ".join(f"{n[:12]:>12}" for n in CHECKED) + "  result")
    for i, (replicas, icc, cap) in enumerate(cells):
        seed = a.seed + i
        cfg = WorkloadConfig(prompts=a.prompts, samples=a.samples, mean_tokens=a.mean_len, cap_tokens=cap,
                             icc=icc, seed=seed)
        workload, previous = make_workload(cfg, epoch=0), make_workload(cfg, epoch=-1)
        bound = lower_bound_s(workload.lengths, workload.prompt_tokens, replicas, model)
        ratios, moves = {}, 0
        for name in CHECKED:
            res = simulate(workload, make_policy(name, workload, previous, model, seed), replicas,
                           model=model, chunk_tokens=a.chunk_tokens)
            ratios[name] = round(res.makespan_s / bound, 4)
            if name == "tail_aware":
                moves = res.moves
        ok = check(ratios, a.margin)
        rows.append({"replicas": replicas, "icc": icc, "cap_tokens": cap, "seed": seed, "ratios": ratios,
                     "tail_aware_moves": moves, "pass": ok})
        print(f"{replicas:>4} {icc:>5} {cap:>6} {seed:>4}  " + " ".join(f"{ratios[n]:>12.3f}" for n in CHECKED)
              + f"  {'PASS' if ok else 'FAIL'}", flush=True)
    passed = sum(r["pass"] for r in rows)
    summary = summarize(rows)
    print("\nper R, paired over cells: geometric mean of tail_aware / baseline (< 1: tail_aware faster)")
    for line in summary_lines(summary):
        print(line)
    print(f"\n{passed}/{len(rows)} cells pass ({time.perf_counter() - started:.0f} s)")
    for r in rows:
        if not r["pass"]:
            print(f"  FAIL R={r['replicas']} icc={r['icc']} cap={r['cap_tokens']} seed={r['seed']}: {r['ratios']}")
    if a.json:
        setup = {k: v for k, v in vars(a).items() if not k.endswith("_list")}
        Path(a.json).write_text(json.dumps({"setup": setup, "rows": rows, "summary": summary, "passed": passed,
                                            "cells": len(rows)}, indent=2))
        print("json:", a.json)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
