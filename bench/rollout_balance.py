"""Compare rollout load-balancing policies on synthetic DAPO batches against the lower bound T*.

--sim: the discrete-event simulator (rollout_ext.balance.simulator) with the step-time model in
rollout_ext.balance.step_model. The length predictor is warmed with one previous epoch of the
same prompts (drifted), as a trainer would have after its first step; the table says so.
Every makespan is reported as T / T*. `tail_aware_oracle` (tail_aware with true lengths) is
run too, so the gap of tail_aware splits into prediction error (tail_aware vs
tail_aware_oracle) and what remains with perfect prediction (move cost and critical path).
`tail_aware_hindsight` (the prediction at dispatch, the true remaining length once a sequence has
started) splits the prediction error in two: what moves could still recover if every survivor's
length were known (tail_aware vs tail_aware_hindsight), and what only dispatch could
(tail_aware_hindsight vs tail_aware_oracle).

Gap attribution (table "gap attribution" and per-row JSON fields):
- prediction error: tail_aware vs tail_aware_oracle (same policy, true lengths), and its share that
  survivors' lengths explain (tail_aware vs tail_aware_hindsight);
- move cost: `move_prefill_s` = total re-prefill seconds of moved sequences (summed over all
  replicas), `move_cost_share` = that / makespan (divide by R for the capacity share);
- critical path: `critical_path_share` = the longest sequence's first admission to finish, / T*
  (its own decode time at the step times it actually saw), `critical_start_share` = when it
  started, `critical_ms_per_token` = its observed mean step time;
- `setup.physical_floor[R]`: how fast the longest sequences can physically go, as shares of T*.

The floor columns (`setup.physical_floor`) bound what any policy can reach on this step model: the
near-cap sequences must all decode near the end, sharing R replicas, and beside saturated bulk a
step is several times slower than alone. Reaching them needs the long sequences isolated almost from
the start, that is, identified before they have generated anything.

--real: real vLLM replicas behind the verl router (bench/balance_real.py; its own flags follow).

Example:
  python bench/rollout_balance.py --sim --replicas 16,128 --json /tmp/b.json --plot /tmp/b.png

Chunks: --chunk-tokens (1024) is the smallest chunk between two boundaries; finer chunks give
the move decision fresher finish times, and a chunk that stays on its replica costs little.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rollout_ext.balance.registry import POLICIES as REGISTRY  # noqa: E402
from rollout_ext.balance.registry import make_policy as registry_policy  # noqa: E402
from rollout_ext.balance.simulator import simulate  # noqa: E402
from rollout_ext.balance.step_model import StepModel, lower_bound_s  # noqa: E402
from rollout_ext.balance.tail_aware import TailAwareConfig  # noqa: E402
from rollout_ext.balance.workload import WorkloadConfig, make_workload  # noqa: E402

from bench.flags import check as _check  # noqa: E402
from bench.flags import int_list as _int_list  # noqa: E402

# Every policy of the registry, the reference runs of tail_aware included (their spec says what they know).
POLICIES = list(REGISTRY)
REAL_BENCH = Path(__file__).with_name("balance_real.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sim", action="store_true", help="simulated replicas")
    mode.add_argument("--real", action="store_true", help="real vLLM replicas (see bench/balance_real.py --help)")
    p.add_argument("--replicas", default="4,16,64,128")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--mean-len", type=float, default=3500.0)
    p.add_argument("--cap", type=int, default=20480)
    p.add_argument("--icc", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="PNG: utilisation timelines; PATH with _ratio for ratio vs R")
    p.add_argument("--timeline-replicas", type=int, default=None, help="R for the timeline plot")
    a = p.parse_args(argv)
    a.replica_list = _int_list("--replicas", a.replicas, 1)
    _check("--prompts", a.prompts, a.prompts >= 1, "integer >= 1")
    _check("--samples", a.samples, a.samples >= 1, "integer >= 1")
    _check("--cap", a.cap, a.cap >= 2, "integer >= 2")
    _check("--mean-len", a.mean_len, 1 <= a.mean_len < a.cap, f"1 <= value < --cap ({a.cap})")
    _check("--icc", a.icc, 0.0 <= a.icc <= 1.0, "0 <= value <= 1")
    _check("--chunk-tokens", a.chunk_tokens, a.chunk_tokens >= 1, "integer >= 1")
    a.policy_list = [x.strip() for x in a.policies.split(",") if x.strip()]
    bad = [x for x in a.policy_list if x not in POLICIES]
    _check("--policies", ",".join(bad), not bad and bool(a.policy_list), ", ".join(POLICIES))
    if a.timeline_replicas is not None:
        _check("--timeline-replicas", a.timeline_replicas, a.timeline_replicas in a.replica_list,
               f"one of --replicas ({a.replicas})")
    return a


def make_policy(name: str, workload, previous, model: StepModel, seed: int):
    """A policy of the registry; predicted ones get a predictor warmed with `previous`, the reference
    ones the true lengths of `workload` (rollout_ext.balance.registry, `PolicySpec.knows`)."""
    return registry_policy(name, model=model, slots_per_replica=model.max_num_seqs, seed=seed,
                           history=previous, workload=workload)


def _versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
           "processor": platform.processor() or platform.machine()}
    try:
        import rollout_ext

        out["rollout_ext"] = rollout_ext.__version__
    except Exception:  # pragma: no cover - reporting only
        pass
    return out


def _attribution(res, workload, bound: float, model: StepModel) -> dict:
    """Where the time went: move cost, and the longest sequence's own lifetime vs T*."""
    lengths = dict(zip(workload.request_ids, map(int, workload.lengths)))
    longest = max(lengths.values())
    # Among the longest sequences, the one that finished last is the critical one.
    crit = max((rid for rid, n in lengths.items() if n == longest), key=res.finish_s.__getitem__)
    life_s = res.finish_s[crit] - res.start_s.get(crit, 0.0)
    last = max(res.finish_s, key=res.finish_s.__getitem__)
    return {
        "move_prefill_s": round(model.prefill_s(res.move_prefill_tokens), 2),
        "move_cost_share": round(model.prefill_s(res.move_prefill_tokens) / max(res.makespan_s, 1e-9), 5),
        "critical_path_share": round(life_s / bound, 4),  # longest sequence: first admission to finish, / T*
        "critical_start_share": round(res.start_s.get(crit, 0.0) / bound, 4),
        "critical_ms_per_token": round(1e3 * life_s / longest, 2),
        "last_finisher_tokens": lengths[last],
        "last_finisher_start_share": round(res.start_s.get(last, 0.0) / bound, 4),
    }


def physical_floor(workload, replicas: int, model: StepModel, bound: float) -> dict:
    """How fast the longest sequences can decode, as shares of T*.

    T* lets the longest sequence decode at tau_1 (alone, no KV read) while all other work runs
    saturated. But all sequences at the cap must decode at the same time near the end, sharing
    R replicas: at least ceil(n_cap / R) per replica even with no bulk beside them, each step
    reading their KV. Beside saturated bulk they crawl at the saturated step time.
    """
    lengths = np.asarray(workload.lengths, dtype=np.float64)
    prompts = np.asarray(workload.prompt_tokens, dtype=np.float64)
    longest = float(lengths.max())
    tail = lengths >= 0.9 * longest
    n_tail = int(tail.sum())
    per_replica = -(-n_tail // replicas)
    ctx = float(np.mean(prompts[tail] + lengths[tail] / 2))
    shared_step_s = model.step_s(per_replica, per_replica * ctx)
    from rollout_ext.balance.step_model import token_weighted_context

    sat_ctx = token_weighted_context(lengths, prompts)
    sat_batch = max(1, min(model.max_num_seqs, int(model.kv_capacity_tokens // sat_ctx)))
    sat_step_s = model.step_s(sat_batch, sat_batch * sat_ctx)
    return {
        "n_near_cap": n_tail,  # sequences >= 0.9 x the longest
        "per_replica": per_replica,
        "lone_share": round(longest * model.lone_token_s / bound, 4),  # what T* assumes
        "shared_tail_share": round(longest * shared_step_s / bound, 4),  # tail sequences only, no bulk
        "shared_tail_step_ms": round(1e3 * shared_step_s, 2),
        "beside_bulk_share": round(longest * sat_step_s / bound, 4),  # crawling in a saturated batch
        "beside_bulk_step_ms": round(1e3 * sat_step_s, 2),
    }


def run(a: argparse.Namespace) -> dict:
    from tqdm import tqdm

    model = StepModel()
    cfg = WorkloadConfig(prompts=a.prompts, samples=a.samples, mean_tokens=a.mean_len, cap_tokens=a.cap,
                         icc=a.icc, seed=a.seed)
    workload = make_workload(cfg, epoch=0)
    previous = make_workload(cfg, epoch=-1)
    results, timelines = [], {}
    jobs = [(r, name) for r in a.replica_list for name in a.policy_list]
    for replicas, name in tqdm(jobs, desc="sim", unit="run"):
        bound = lower_bound_s(workload.lengths, workload.prompt_tokens, replicas, model)
        policy = make_policy(name, workload, previous, model, a.seed)
        started = time.perf_counter()
        res = simulate(workload, policy, replicas, model=model, chunk_tokens=a.chunk_tokens)
        row = {
            "policy": name,
            "replicas": replicas,
            "makespan_s": round(res.makespan_s, 3),
            "lower_bound_s": round(bound, 3),
            "ratio": round(res.makespan_s / bound, 4),
            "tail_fraction": round(res.tail_fraction(replicas), 4),
            "idle_replica_s": round(res.idle_replica_s(replicas), 1),
            "moves": res.moves,
            "preemptions": res.preemptions,
            "sim_wall_s": round(time.perf_counter() - started, 2),
        }
        row.update(_attribution(res, workload, bound, model))
        if "predictor" in res.snapshot:
            row["predictor"] = res.snapshot["predictor"]
        results.append(row)
        times, counts = res.busy_count_timeline()
        timelines[(name, replicas)] = (times / bound, counts / replicas)
    setup = {
        "mode": "sim",
        "workload": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
        "replicas": a.replica_list,
        "chunk_tokens": a.chunk_tokens,
        "step_model": {f: getattr(model, f) for f in model.__dataclass_fields__},
        "step_model_formula": "step_s = base_ms + kv_tokens*kv_read_ns_per_token + num_seqs*per_seq_us",
        "tail_aware_config": {f: getattr(TailAwareConfig(), f) for f in TailAwareConfig.__dataclass_fields__},
        "predictor_history": "warmed with one previous epoch of the same prompts (drift 0.3)",
        "lower_bound": "max_k k*tau_1 + (sum (L_i-k)^+ / X_sat + prefill)/R, X_sat at token-weighted context",
        "versions": _versions(),
        "seed": a.seed,
    }
    setup["physical_floor"] = {
        str(r): physical_floor(workload, r, model, lower_bound_s(workload.lengths, workload.prompt_tokens, r, model))
        for r in a.replica_list}
    return {"setup": setup, "results": results, "_timelines": timelines}


def print_table(out: dict) -> None:
    rows = out["results"]
    reps = sorted({r["replicas"] for r in rows})
    names = [n for n in POLICIES if any(r["policy"] == n for r in rows)]
    print("ratio T/T* (lower is better; predictor warmed with one previous epoch)")
    print(f"{'policy':<22}" + "".join(f"R={r:<8}" for r in reps))
    for n in names:
        cells = {r["replicas"]: r for r in rows if r["policy"] == n}
        print(f"{n:<22}" + "".join(f"{cells[r]['ratio']:<10.3f}" for r in reps))
    print(f"{'T* (s)':<22}" + "".join(
        f"{next(r['lower_bound_s'] for r in rows if r['replicas'] == rep):<10.1f}" for rep in reps))
    print("\npolicy                 R     makespan_s  tail_frac  idle_rep_s  moves  preempt")
    for r in rows:
        print(f"{r['policy']:<22} {r['replicas']:<5} {r['makespan_s']:<11.1f} {r['tail_fraction']:<10.3f} "
              f"{r['idle_replica_s']:<11.1f} {r['moves']:<6} {r['preemptions']}")
    print("\ngap attribution (shares of T*; move cost as a share of the makespan)")
    print("R     tail_aware  ta_oracle  pred_gap  survivors  move_cost  crit_path  crit_start  crit_ms/tok"
          "  | floor: lone  shared_tail  beside_bulk  n_near_cap")
    for rep in reps:
        cells = {r["policy"]: r for r in rows if r["replicas"] == rep}
        ta, orc, hind = (cells.get(n) for n in ("tail_aware", "tail_aware_oracle", "tail_aware_hindsight"))
        if ta is None:
            continue
        gap = f"{ta['ratio'] - orc['ratio']:+.3f}" if orc else "n/a"
        survivors = f"{ta['ratio'] - hind['ratio']:+.3f}" if hind else "n/a"
        fl = out["setup"]["physical_floor"][str(rep)]
        print(f"{rep:<5} {ta['ratio']:<11.3f} {orc['ratio'] if orc else float('nan'):<10.3f} {gap:<9} {survivors:<10} "
              f"{ta['move_cost_share']:<10.4f} {ta['critical_path_share']:<10.3f} {ta['critical_start_share']:<11.3f} "
              f"{ta['critical_ms_per_token']:<12.2f} | {fl['lone_share']:<11.3f} {fl['shared_tail_share']:<12.3f} "
              f"{fl['beside_bulk_share']:<12.3f} {fl['n_near_cap']}")
    for r in rows:
        if r["policy"] == "tail_aware" and "predictor" in r:
            print(f"predictor calibration (R={r['replicas']}): {r['predictor']}")


def plot(out: dict, path: str, timeline_r: int | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["results"]
    reps = sorted({r["replicas"] for r in rows})
    r_line = timeline_r or reps[len(reps) // 2]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, color in (("verl_default", "tab:red"), ("tail_aware", "tab:blue"), ("tail_aware_oracle", "tab:green")):
        key = (name, r_line)
        if key in out["_timelines"]:
            t, c = out["_timelines"][key]
            ax.step(t, c, where="post", label=name, color=color)
    ax.axvline(1.0, color="k", ls="--", lw=1, label="lower bound T*")
    ax.set_xlabel("time / T*")
    ax.set_ylabel("share of replicas busy")
    ax.set_title(f"Replica utilisation, R={r_line}")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

    second = str(Path(path).with_name(Path(path).stem + "_ratio" + Path(path).suffix))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in POLICIES:
        pts = sorted((r["replicas"], r["ratio"]) for r in rows if r["policy"] == name)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(1.10, color="k", ls=":", lw=1, label="aim 1.10")
    ax.set_xscale("log", base=2)
    ax.set_xticks(reps)
    ax.set_xticklabels([str(r) for r in reps])
    ax.set_xlabel("replicas R")
    ax.set_ylabel("makespan / T*")
    ax.set_title("Makespan over lower bound per policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [path, second]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--real" in argv:
        # Real replicas have their own flags: run that bench as its own script, with them.
        import runpy

        sys.argv = [str(REAL_BENCH), *(arg for arg in argv if arg != "--real")]
        runpy.run_path(str(REAL_BENCH), run_name="__main__")
        return 0
    a = parse_args(argv)
    print(f"host: {platform.node()} {platform.machine()} python {platform.python_version()}; seed {a.seed}")
    out = run(a)
    print_table(out)
    if a.plot:
        print("plots:", ", ".join(plot(out, a.plot, a.timeline_replicas)))
    if a.json:
        clean = {k: v for k, v in out.items() if not k.startswith("_")}
        Path(a.json).write_text(json.dumps(clean, indent=2))
        print("json:", a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
