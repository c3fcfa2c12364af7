"""Does tail_aware win on replicas it was not tuned for? A sweep over step models, R, ICC and seeds.

Every cell is one workload (a DAPO batch with long-tailed, group-correlated lengths) simulated on R
replicas whose step time follows one of the step models in `STEP_MODELS` (the project default,
KV-heavy, per-sequence-heavy), on replicas of equal speed or, with --replica-speeds, of unequal speed
(`REPLICA_SPEEDS` in rollout_ext/balance/simulator.py: one replica 1.5x slower, or 0.8x..1.25x). Per
cell it runs:
- verl_default with --verl-seeds tie-break seeds; its mean makespan is the baseline, because single
  runs swing by several percent;
- tail_aware_placement and tail_aware, whose predictor is warmed with one previous epoch.

The policies are given the project's default step model as their prior (--policy-model default),
not the cell's true constants; `true` hands them the truth, and `off` the truth with every timing
constant wrong by --prior-error in alternating directions. tail_aware refines its prior from the
simulated clock (rollout_ext/balance/calibration.py) unless --no-clock.

--oracle adds oracle_lpt (true lengths, longest first, no moves) per cell: what placement alone could
reach with perfect predictions, a yardstick for the target. --hindsight adds tail_aware_hindsight: the
predicted lengths at dispatch, the true remaining length of every sequence once it has started, and
moves on small gains (rollout_ext/balance/registry.py, HINDSIGHT_MOVES): what moves could reach if survivors'
lengths were known, so what is left between it and oracle_lpt only dispatch can win.

--plot PNG draws every cell over its verl_default mean, one panel per step model, with verl's tie-break
range, the yardsticks that ran and the target; --replot JSON redraws it from an earlier sweep's --json.

--compare OTHER.json prints, per step model, tail_aware's makespan over the same cell's in another
sweep's JSON (the calibration check: an `off` run against a `true --no-clock` run).

A cell passes when tail_aware / mean(verl_default) <= 1. The sweep passes when every cell does and
the geometric mean over all cells is <= --target. Makespans are also reported against the two lower
bounds, T* and T*_dl (rollout_ext/balance/step_model.py).

Examples (512x16 prompts, 48 cells; ~20 min on 2 cores):
  python bench/balance_sweep.py --json out/sweep.json
  python bench/balance_sweep.py --policy-model true --no-clock --json out/sweep_true.json
  python bench/balance_sweep.py --policy-model off --prior-error 2.5 --compare out/sweep_true.json
  python bench/balance_sweep.py --replot out/sweep.json --plot out/sweep.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_ext.balance.calibration import off_by  # noqa: E402
from rollout_ext.balance.registry import make_policy  # noqa: E402
from rollout_ext.balance.simulator import REPLICA_SPEEDS, simulate  # noqa: E402
from rollout_ext.balance.step_model import (DRAFTING, STEP_MODELS, StepModel, drafted, lower_bound_dl_s,  # noqa: E402
                                            lower_bound_s, scaled)
from rollout_ext.balance.workload import WorkloadConfig, make_workload  # noqa: E402

POLICIES = ("tail_aware_placement", "tail_aware")
# Reference policies -> the flag (and cell field) that adds them, their summary key and column label.
YARDSTICKS = {"oracle_lpt": ("oracle", "oracle_vs_verl_geo", "oracle/verl"),
              "tail_aware_hindsight": ("hindsight", "hindsight_vs_verl_geo", "hindsight/verl")}


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
    p.add_argument("--step-models", default=",".join(STEP_MODELS), help=f"from {', '.join(STEP_MODELS)}")
    p.add_argument("--replicas", default="4,16,64,128")
    p.add_argument("--replica-speeds", default="equal", help=f"from {', '.join(REPLICA_SPEEDS)}")
    p.add_argument("--drafting", default="none",
                   help=f"tail drafting profiles for the tail-aware policies, from {', '.join(DRAFTING)} (verl_default "
                        "never drafts); the bounds are drafted too")
    p.add_argument("--iccs", default="0.3,0.85")
    p.add_argument("--caps", default="20480")
    p.add_argument("--seeds", type=int, default=2, help="workload seeds per (step model, R, ICC, cap)")
    p.add_argument("--verl-seeds", type=int, default=5, help="tie-break seeds of the verl_default baseline")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--mean-len", type=float, default=3500.0)
    p.add_argument("--seed", type=int, default=0, help="base seed; the workload seeds are seed, seed + 1, ...")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--policy-model", choices=("default", "true", "off"), default="default",
                   help="step model the policies are given: the project default, the cell's own, or it off")
    p.add_argument("--prior-error", type=float, default=2.5, help="with --policy-model off: the factor")
    p.add_argument("--no-clock", action="store_true", help="the simulator passes no time (no calibration)")
    p.add_argument("--round-trip-ms", type=float, default=0.0,
                   help="caller round trip before dispatched work reaches a replica (simulator.py: round_trip_s)")
    p.add_argument("--compare", default=None, help="another sweep's JSON: tail_aware here over tail_aware there")
    p.add_argument("--target", type=float, default=0.92, help="required geometric mean of tail_aware / verl_default")
    p.add_argument("--oracle", action="store_true",
                   help="also run oracle_lpt (true lengths, longest first): what placement alone could reach")
    p.add_argument("--hindsight", action="store_true",
                   help="also run tail_aware_hindsight (true remaining lengths once started): what moves could reach")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells simulated in parallel")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: every cell over its verl_default mean, a panel per step model")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="draw --plot from an earlier sweep's --json instead of simulating")
    a = p.parse_args(argv)
    if a.replot and not a.plot:
        raise SystemExit(f"error: --replot={a.replot}: also give --plot PATH (the PNG to write)")
    a.model_list = _list("--step-models", a.step_models, str, lambda v: v in STEP_MODELS, ", ".join(STEP_MODELS))
    a.replica_list = _list("--replicas", a.replicas, int, lambda v: v >= 1, "integers >= 1")
    a.speeds_list = _list("--replica-speeds", a.replica_speeds, str, lambda v: v in REPLICA_SPEEDS,
                          ", ".join(REPLICA_SPEEDS))
    a.drafting_list = _list("--drafting", a.drafting, str, lambda v: v in DRAFTING, ", ".join(DRAFTING))
    a.icc_list = _list("--iccs", a.iccs, float, lambda v: 0 <= v <= 1, "numbers in [0, 1]")
    a.cap_list = _list("--caps", a.caps, int, lambda v: v > a.mean_len, f"integers > --mean-len ({a.mean_len})")
    if a.prior_error <= 0:
        raise SystemExit(f"error: --prior-error={a.prior_error}; allowed: a number > 0")
    if not a.round_trip_ms >= 0:
        raise SystemExit(f"error: --round-trip-ms={a.round_trip_ms}; allowed: a number >= 0")
    for name in ("prompts", "samples", "seeds", "verl_seeds", "chunk_tokens", "jobs"):
        if getattr(a, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')}={getattr(a, name)}; allowed: integers >= 1")
    return a


def run_cell(cell: dict) -> dict:
    """Simulate one cell: verl_default over its tie-break seeds, then the tail-aware policies (with the
    cell's drafting profile, if any: only they draft)."""
    plain = STEP_MODELS[cell["step_model"]]
    profile = cell.get("drafting", "none")
    model = drafted(plain, profile)
    policy_model = {"default": drafted(StepModel(), profile), "true": model,
                    "off": off_by(model, cell["prior_error"])}[cell["policy_model"]]
    cfg = WorkloadConfig(prompts=cell["prompts"], samples=cell["samples"], mean_tokens=cell["mean_len"],
                         cap_tokens=cell["cap_tokens"], icc=cell["icc"], seed=cell["seed"])
    workload, previous = make_workload(cfg, epoch=0), make_workload(cfg, epoch=-1)
    replicas = cell["replicas"]
    speeds = REPLICA_SPEEDS[cell["replica_speeds"]](replicas)
    # The bounds assume equal replicas: built on the fastest one, they stay bounds.
    fastest = scaled(model, min(speeds))
    t_star = lower_bound_s(workload.lengths, workload.prompt_tokens, replicas, fastest)
    t_dl = lower_bound_dl_s(workload.lengths, workload.prompt_tokens, replicas, fastest)
    started = time.perf_counter()

    def run(name: str, seed: int):
        policy = make_policy(name, model=policy_model, seed=seed, history=previous, workload=workload)
        return simulate(workload, policy, replicas, model=plain if name == "verl_default" else model,
                        chunk_tokens=cell["chunk_tokens"],
                        clock=cell["clock"], round_trip_s=cell["round_trip_ms"] * 1e-3,
                        speeds=speeds)

    verl = [run("verl_default", seed).makespan_s for seed in range(cell["verl_seeds"])]
    makespan = {"verl_default": statistics.fmean(verl)}
    moves = {}
    for name in POLICIES + tuple(name for name, (flag, _, _) in YARDSTICKS.items() if cell.get(flag)):
        res = run(name, 0)
        makespan[name], moves[name] = res.makespan_s, res.moves
    return {**cell, "t_star_s": t_star, "t_dl_s": t_dl, "makespan_s": makespan, "verl_default_runs_s": verl,
            "verl_default_spread": (max(verl) - min(verl)) / makespan["verl_default"], "moves": moves,
            "vs_verl": {n: v / makespan["verl_default"] for n, v in makespan.items() if n != "verl_default"},
            "vs_t_star": {n: v / t_star for n, v in makespan.items()},
            "vs_t_dl": {n: v / t_dl for n, v in makespan.items()}, "wall_s": time.perf_counter() - started}


def _geo(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: list[dict], target: float) -> dict:
    """Per step model and overall: geometric mean and worst cell of tail_aware against the baseline
    and against both bounds."""
    def entry(cells):
        worst = max(cells, key=lambda r: r["vs_verl"]["tail_aware"])
        out = {"cells": len(cells),
                "vs_verl_geo": _geo(r["vs_verl"]["tail_aware"] for r in cells),
                "vs_verl_worst": worst["vs_verl"]["tail_aware"],
                "worst_cell": {**{k: worst[k] for k in ("step_model", "replicas", "icc", "cap_tokens", "seed")},
                               "replica_speeds": _speeds(worst)},
                "placement_vs_verl_geo": _geo(r["vs_verl"]["tail_aware_placement"] for r in cells),
                "vs_t_star_geo": _geo(r["vs_t_star"]["tail_aware"] for r in cells),
                "vs_t_star_worst": max(r["vs_t_star"]["tail_aware"] for r in cells),
                "vs_t_dl_geo": _geo(r["vs_t_dl"]["tail_aware"] for r in cells),
                "vs_t_dl_worst": max(r["vs_t_dl"]["tail_aware"] for r in cells),
                "verl_vs_t_dl_geo": _geo(r["vs_t_dl"]["verl_default"] for r in cells),
                "cells_above_1": sum(r["vs_verl"]["tail_aware"] > 1.0 for r in cells)}
        for name, (_, key, _) in YARDSTICKS.items():
            if all(name in r["vs_verl"] for r in cells):
                out[key] = _geo(r["vs_verl"][name] for r in cells)
        return out

    def per(key):
        return {name: entry([r for r in rows if key(r) == name]) for name in dict.fromkeys(map(key, rows))}

    overall = entry(rows)
    overall["pass"] = overall["cells_above_1"] == 0 and overall["vs_verl_geo"] <= target
    return {"per_step_model": per(lambda r: r["step_model"]), "per_replica_speeds": per(_speeds),
            "per_drafting": per(lambda r: r.get("drafting", "none")),
            "per_replicas": per(lambda r: r["replicas"]), "overall": overall, "target": target}


def _speeds(row: dict) -> str:
    return row.get("replica_speeds", "equal")  # sweeps before the axis ran equal replicas


def summary_lines(summary: dict) -> list[str]:
    head = (f"{'step model':<14} {'cells':>5}  {'TA/verl geo':>11} {'worst':>6} {'>1':>3}  {'TAplace/verl':>12}"
            f"  {'TA/T* geo':>9} {'worst':>6}  {'TA/T*dl geo':>11} {'worst':>6}  {'verl/T*dl':>9}")
    # (summary key, label, column width) of each reference policy the sweep ran
    shown = [(key, label, max(11, len(label))) for _, key, label in YARDSTICKS.values() if key in summary["overall"]]
    lines = [head + "".join(f"  {label:>{w}}" for _, label, w in shown)]
    speeds = summary.get("per_replica_speeds", {})
    by_speeds = [(f"speeds {name}", e) for name, e in speeds.items()] if len(speeds) > 1 else []
    by_r = summary.get("per_replicas", {})
    by_r = [(f"R={name}", e) for name, e in by_r.items()] if len(by_r) > 1 else []
    by_drafting = summary.get("per_drafting", {})
    by_drafting = [(f"draft {name}", e) for name, e in by_drafting.items()] if len(by_drafting) > 1 else []
    for name, e in [*summary["per_step_model"].items(), *by_speeds, *by_r, *by_drafting, ("all", summary["overall"])]:
        lines.append(f"{name:<14} {e['cells']:>5}  {e['vs_verl_geo']:>11.3f} {e['vs_verl_worst']:>6.3f} "
                     f"{e['cells_above_1']:>3}  {e['placement_vs_verl_geo']:>12.3f}  {e['vs_t_star_geo']:>9.3f} "
                     f"{e['vs_t_star_worst']:>6.3f}  {e['vs_t_dl_geo']:>11.3f} {e['vs_t_dl_worst']:>6.3f}  "
                     f"{e['verl_vs_t_dl_geo']:>9.3f}" + "".join(f"  {e[key]:>{w}.3f}" for key, _, w in shown))
    return lines


CELL_KEY = ("step_model", "replicas", "icc", "cap_tokens", "seed", "prompts", "samples", "chunk_tokens")


def _cell_key(row: dict) -> tuple:
    return (*(row[k] for k in CELL_KEY), _speeds(row), row.get("drafting", "none"))


def compare_lines(rows: list[dict], other_rows: list[dict]) -> list[str]:
    """tail_aware's makespan here over the same cell's in `other_rows`, per step model."""
    other = {_cell_key(r): r for r in other_rows}
    pairs: dict[str, list[float]] = {}
    for row in rows:
        match = other.get(_cell_key(row))
        if match is not None:
            pairs.setdefault(row["step_model"], []).append(
                row["makespan_s"]["tail_aware"] / match["makespan_s"]["tail_aware"])
    if not pairs:
        return ["compare: no cell in common"]
    lines = [f"\ntail_aware here / tail_aware in --compare, same cells:", f"{'step model':<14} {'cells':>5} "
             f"{'geo':>7} {'best':>7} {'worst':>7}"]
    for name, ratios in [*pairs.items(), ("all", [r for v in pairs.values() for r in v])]:
        lines.append(f"{name:<14} {len(ratios):>5} {_geo(ratios):>7.4f} {min(ratios):>7.4f} {max(ratios):>7.4f}")
    return lines


def plot(data: dict, path: str) -> None:
    """One panel per step model: each cell's makespan over its verl_default mean, per R; verl's own
    tie-break range as a grey bar (the noise a cell sits in), the yardsticks that ran, the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("rows") or []
    if not rows:
        raise SystemExit("--plot: the sweep has no rows to draw")
    models = list(dict.fromkeys(r["step_model"] for r in rows))
    replicas = sorted({r["replicas"] for r in rows})
    iccs = sorted({r["icc"] for r in rows})
    target = data.get("summary", {}).get("target")
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 1, 4.6), sharey=True, squeeze=False)
    marks = {"tail_aware": ("tab:blue", "o", "tail_aware"), "oracle_lpt": ("black", "x", "oracle_lpt (true lengths)"),
             "tail_aware_hindsight": ("tab:orange", "+", "hindsight (true survivor lengths)")}
    for ax, model in zip(axes[0], models):
        cells = [r for r in rows if r["step_model"] == model]
        for x, reps in enumerate(replicas):
            here = [r for r in cells if r["replicas"] == reps]
            for k, r in enumerate(here):
                dx = 0.5 * ((k + 0.5) / len(here) - 0.5)
                runs = [v / r["makespan_s"]["verl_default"] for v in r["verl_default_runs_s"]]
                ax.vlines(x + dx, min(runs), max(runs), color="0.75", linewidth=4, zorder=1)
                for name, (color, marker, _) in marks.items():
                    if name not in r["vs_verl"]:
                        continue
                    if marker in "x+":  # line markers have no face to leave open
                        ax.scatter(x + dx, r["vs_verl"][name], color=color, marker=marker, s=26, zorder=3)
                    else:
                        ax.scatter(x + dx, r["vs_verl"][name], color=color if r["icc"] == iccs[0] else "white",
                                   edgecolors=color, marker=marker, s=26, zorder=3)
            if here:
                ax.plot([x - 0.3, x + 0.3], [_geo(r["vs_verl"]["tail_aware"] for r in here)] * 2,
                        color="tab:blue", linewidth=1.2, zorder=2)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", zorder=0)
        if target is not None:
            ax.axhline(target, color="tab:red", linewidth=0.8, linestyle=":", zorder=0)
        e = data["summary"]["per_step_model"][model] if "summary" in data else summarize(cells, 1.0)["overall"]
        ax.set_title(f"{model}: TA/verl geo {e['vs_verl_geo']:.3f}, worst {e['vs_verl_worst']:.3f}", fontsize=9)
        ax.set_xticks(range(len(replicas)), [f"R={r}" for r in replicas])
    axes[0][0].set_ylabel("makespan / verl_default mean (same cell)")
    handles = [plt.Line2D([], [], color=c, marker=m, linestyle="", label=label) for c, m, label in
               (marks[n] for n in marks if any(n in r["vs_verl"] for r in rows))]
    handles += [plt.Line2D([], [], color="0.75", linewidth=4, label="verl_default tie-break range"),
                plt.Line2D([], [], color="tab:blue", label="tail_aware geo per R")]
    if len(iccs) > 1:
        handles.append(plt.Line2D([], [], color="tab:blue", marker="o", markerfacecolor="white", linestyle="",
                                  label=f"tail_aware, ICC {', '.join(map(str, iccs[1:]))} (filled: {iccs[0]})"))
    if target is not None:
        handles.append(plt.Line2D([], [], color="tab:red", linestyle=":", label=f"target geo {target}"))
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    overall = data.get("summary", {}).get("overall") or summarize(rows, 1.0)["overall"]
    fig.suptitle(f"{len(rows)} cells, {rows[0]['prompts']}x{rows[0]['samples']} prompts: tail_aware/verl geo "
                 f"{overall['vs_verl_geo']:.3f}, worst {overall['vs_verl_worst']:.3f}, "
                 f"{overall['cells_above_1']} above 1", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), a.plot)
        print("plot:", a.plot)
        return 0
    cells = [{"step_model": m, "drafting": d, "replica_speeds": sp, "replicas": r, "icc": icc, "cap_tokens": cap, "seed": a.seed + k,
              "prompts": a.prompts, "samples": a.samples, "mean_len": a.mean_len, "chunk_tokens": a.chunk_tokens,
              "verl_seeds": a.verl_seeds, "policy_model": a.policy_model, "prior_error": a.prior_error,
              "clock": not a.no_clock, **{flag: getattr(a, flag) for flag, _, _ in YARDSTICKS.values()},
              "round_trip_ms": a.round_trip_ms}
             for d in a.drafting_list for sp in a.speeds_list for m in a.model_list for r in a.replica_list for icc in a.icc_list
             for cap in a.cap_list for k in range(a.seeds)]
    print(f"{len(cells)} cells: {a.prompts}x{a.samples} prompts, mean {a.mean_len:.0f}, chunk {a.chunk_tokens}, "
          f"verl_default over {a.verl_seeds} seeds, policies given the {a.policy_model} step model"
          + (f" (x{a.prior_error} alternating)" if a.policy_model == "off" else "")
          + (", no clock" if a.no_clock else ", calibrated from the clock")
          + (f", {a.round_trip_ms:g} ms round trip per dispatch" if a.round_trip_ms else "") + f", {a.jobs} jobs")
    print(f"{'#':>3} {'step model':<14} {'speeds':<9} {'R':>4} {'icc':>5} {'cap':>6} {'seed':>4}  "
          f"{'verl±spread':>12} {'TAplace/verl':>12} {'TA/verl':>8} {'TA/T*dl':>8} {'moves':>6}  wall")
    rows, started = [], time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        for i, row in enumerate(pool.map(run_cell, cells), 1):
            rows.append(row)
            print(f"{i:>3} {row['step_model']:<14} {row['replica_speeds']:<9} {row['replicas']:>4} {row['icc']:>5} "
                  f"{row['cap_tokens']:>6} {row['seed']:>4}  {row['vs_t_dl']['verl_default']:>6.3f}±{row['verl_default_spread'] / 2:<5.3f}"
                  f"{row['vs_verl']['tail_aware_placement']:>12.3f} {row['vs_verl']['tail_aware']:>8.3f} "
                  f"{row['vs_t_dl']['tail_aware']:>8.3f} {row['moves']['tail_aware']:>6}  {row['wall_s']:.0f} s",
                  flush=True)
    summary = summarize(rows, a.target)
    print("\ngeometric mean and worst cell of tail_aware (TA) over the verl_default mean, and over the bounds")
    for line in summary_lines(summary):
        print(line)
    overall = summary["overall"]
    verdict = "PASS" if overall["pass"] else "FAIL"
    print(f"\n{verdict}: {overall['cells_above_1']} cell(s) above 1.0; geometric mean {overall['vs_verl_geo']:.3f} "
          f"(target <= {a.target}); {time.perf_counter() - started:.0f} s")
    if a.compare:
        for line in compare_lines(rows, json.loads(Path(a.compare).read_text())["rows"]):
            print(line)
    if a.json:
        setup = {k: v for k, v in vars(a).items() if not k.endswith("_list")}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"setup": setup, "rows": rows, "summary": summary}, indent=1))
        print("json:", a.json)
    if a.plot:
        plot({"rows": rows, "summary": summary}, a.plot)
        print("plot:", a.plot)
    return 0 if overall["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
