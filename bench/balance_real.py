"""Balancing policies on real vLLM CPU replicas behind verl's router path, in one run.

Setup: verl's LLMServerManager starts `--replicas` rollout_ext replicas of the tiny model; for each
policy a fresh TailAwareRouter (rollout_ext.verl.router) is started by verl's own
`get_router_handle` from a router YAML, and a ChunkedLLMServerClient (rollout_ext.verl.continuation)
sends every sample of the synthetic batch at once, in `--chunk-tokens` chunks. The makespan is the
wall time from the first request to the last finished one. All policies run on the same replicas
and the same workload, one after another.

Workloads (`--workload`):
- `arith` (default): natural lengths. The trained arithmetic model (rollout_ext.testing.arith_model,
  built by `make setup`) answers held-out problems with 1 to 8 operands (rollout_ext.testing.arith_props),
  sampled at temperature 1, so lengths follow the prompt, vary between siblings, and some samples
  ramble to the cap, as a policy's do. Every request has its own sampling seed, derived from
  (--seed, epoch, prompt, sample), so every policy and repeat decodes the same batch.
- `forced`: rollout_ext.balance.workload draws true lengths (long-tailed, group-correlated, then
  clipped to [--min-len, --cap]) for the random-weight tiny model, which would almost never stop by
  itself; each request carries `extra_args.eos_at_total = prompt + length` and a test-only vLLM
  logits processor (rollout_ext.testing.forced_length) emits EOS exactly there.
Either way the router never sees a length: the chunked client sends it only the prompt tokens and
the cap, and the policy gets a Request (prompt length, cap, group hash). Each policy first rolls out
warm-up epochs of the same prompts (new samples; for `forced`, a drifted prompt effect) so the
length predictor has per-prompt history, as in a training run.

Run it through the environment Ray needs to stay on 127.0.0.1:
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python bench/balance_real.py --json out.json
Importable: `run_real(args)` returns the JSON dict; `main(argv)` parses, runs and prints.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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

from rollout_ext.balance.workload import WorkloadConfig, make_workload  # noqa: E402

FIRST_PROMPT_TOKEN = 3  # ids 0..2 are bos/eos/pad in the tiny model
# workload -> (default model, what decides each length)
WORKLOADS = {
    "arith": (REPO / ".cache" / "models" / "arith-qwen2", "the model's own EOS, temperature 1, a seed per sample"),
    "forced": (REPO / ".cache" / "models" / "tiny-qwen2",
               "vLLM logits processor rollout_ext.testing.forced_length (EOS at prompt+length)"),
}
ARITH_OPERAND_COUNTS = 8
ARITH_PROMPT_SEED = 3_000_017  # held out from the model's training and from arith_props' prompts
NOISE_ROW = "verl_default_unchunked"  # runs verl_default's policy again: its spread is the noise


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="arith",
                   help="arith: the trained model's natural lengths; forced: drawn lengths, EOS forced")
    p.add_argument("--model", default=None, help="default: .cache/models/arith-qwen2 (arith), tiny-qwen2 (forced)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="verl_default,tail_aware")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--mean-len", type=float, default=120.0)
    p.add_argument("--prompt-tokens", type=int, default=32, help="mean prompt length")
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="per replica; below samples/replica so that admission order matters")
    p.add_argument("--no-unchunked", action="store_true",
                   help="skip the rows without chunks (verl_default and tail_aware on whole sequences)")
    p.add_argument("--warm-epochs", type=int, default=1, help="epochs rolled out before the measured one")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per policy (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-ms", type=float, default=0.0,
                   help="one replica sleeps this long in every decode step (a degraded replica; "
                        "rollout_ext.testing.slow_steps), for every row")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: every repeat's makespan over verl_default's, per row")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="draw --plot from an earlier run's --json instead of running (no engines start)")
    a = p.parse_args(argv)
    a.policy_list = [x.strip() for x in a.policies.split(",") if x.strip()]
    a.model = a.model or str(WORKLOADS[a.workload][0])
    if a.workload == "arith" and a.prompts < ARITH_OPERAND_COUNTS:
        p.error(f"--prompts={a.prompts} with --workload arith; allowed: at least {ARITH_OPERAND_COUNTS} "
                "(one per operand count)")
    if a.replicas < 1 or a.chunk_tokens < 1 or not 1 <= a.min_len < a.cap:
        p.error("--replicas >= 1, --chunk-tokens >= 1, 1 <= --min-len < --cap required")
    if a.replot and not a.plot:
        p.error(f"--replot={a.replot}: also give --plot PATH (the PNG to write)")
    if not a.slow_ms >= 0 or (a.slow_ms > 0 and a.replicas < 2):
        p.error(f"--slow-ms={a.slow_ms}; allowed: 0 (off), or a number > 0 with --replicas >= 2")
    return a


# ---- workload -------------------------------------------------------------------------------------
def make_jobs(a, epoch: int) -> list[dict]:
    """One job per sample: prompt ids (same ids for the same prompt in every epoch) and, for
    `forced`, the true length; for `arith`, the sample's seed (the length is the model's)."""
    if a.workload == "arith":
        return arith_jobs(a, epoch)
    cfg = WorkloadConfig(prompts=a.prompts, samples=a.samples, mean_tokens=a.mean_len, cap_tokens=a.cap,
                         mean_prompt_tokens=a.prompt_tokens, seed=a.seed)
    w = make_workload(cfg, epoch=epoch)
    jobs = []
    for i in range(len(w)):
        prompt = i // a.samples
        rng = np.random.default_rng([a.seed, prompt])
        n = int(min(w.prompt_tokens[i], 4 * a.prompt_tokens))
        ids = rng.integers(FIRST_PROMPT_TOKEN, 1000, n).tolist()
        jobs.append({"request_id": f"{w.request_ids[i]}-{a.seed}", "prompt_ids": ids,
                     "length": int(np.clip(w.lengths[i], a.min_len, a.cap))})
    return jobs


def arith_jobs(a, epoch: int) -> list[dict]:
    from rollout_ext.testing.arith_props import held_out_problems

    tokenizer = _tokenizer(a.model)
    jobs = []
    for p, problem in enumerate(held_out_problems(a.prompts, seed=ARITH_PROMPT_SEED + a.seed)):
        ids = tokenizer.encode(problem.prompt, add_special_tokens=False)
        for k in range(a.samples):
            seed = int(np.random.SeedSequence([a.seed, epoch + 1_000, p, k]).generate_state(1)[0])
            jobs.append({"request_id": f"e{epoch}-p{p}-s{k}-{a.seed}", "prompt_ids": ids, "length": None,
                         "seed": seed, "operands": problem.num_operands})
    return jobs


@functools.cache
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# ---- replicas, router, client ---------------------------------------------------------------------
def start_replicas(a, slow_dir: Path | None = None):
    """verl's LLMServerManager with rollout_ext replicas of the tiny model (Ray on 127.0.0.1). With
    `slow_dir`, the engines also load the slow-steps processor, controlled from that folder."""
    from rollout_ext.testing import forced_length, slow_steps
    from rollout_ext.verl.tiny_run import compose, init_local_ray, rollout_overrides

    prompt_len = 4 * a.prompt_tokens
    overrides = rollout_overrides(a.model, replicas=a.replicas, prompt_length=prompt_len, response_length=a.cap)
    processors = ([forced_length.FQCN] if a.workload == "forced" else []) + ([slow_steps.FQCN] if slow_dir else [])
    overrides = [o for o in overrides if "max_num_seqs" not in o] + [
        f"actor_rollout_ref.rollout.max_num_seqs={a.max_num_seqs}",
        # vLLM's counters (speculative decoding among them), read back with spec_decode_counts().
        "actor_rollout_ref.rollout.disable_log_stats=False",
    ]
    if processors:
        overrides.append(f"+actor_rollout_ref.rollout.engine_kwargs.rollout_ext.logits_processors=[{','.join(processors)}]")
    if slow_dir:
        overrides.append("+actor_rollout_ref.rollout.engine_kwargs.rollout_ext.additional_config="
                         f"{{{slow_steps.CONFIG_KEY}:'{slow_dir}'}}")
    config = compose(overrides)
    init_local_ray(a.replicas, _cache_env())
    from verl.workers.rollout.llm_server import LLMServerManager

    return config, LLMServerManager.create(config, worker_group=None)


def slow_one_replica(manager, slow_dir: Path, step_ms: float) -> str:
    """Make the engine of the manager's last replica sleep `step_ms` per decode step; returns the
    replica's address (the router's id for it)."""
    import ray

    from rollout_ext.testing import slow_steps

    address, handle = manager.server_addresses[-1], manager.server_handles[-1]
    server_pid = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()))
    slow_steps.set_slow(slow_dir, {slow_steps.engine_under(slow_dir, server_pid): step_ms})
    return address


def spec_decode_counts(manager) -> dict[str, int]:
    """vLLM's speculative decoding counters, summed over the manager's replicas (their servers'
    in-process metrics)."""
    import ray

    def read(_server):
        from vllm.v1.metrics.reader import get_metrics_snapshot

        from rollout_ext.testing.greedy import spec_decode_counts

        return spec_decode_counts(get_metrics_snapshot())

    found = ray.get([h.__ray_call__.remote(read) for h in manager.server_handles])
    return {key: sum(counts[key] for counts in found) for key in found[0]}


def _cache_env() -> dict[str, str]:
    cache = REPO / ".cache"
    return {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def make_router(manager, policy: str, chunk_tokens: int, slots: int, tmp: Path, extra: str = ""):
    """A fresh router actor over the manager's replicas, built by verl from a router YAML."""
    from verl.workers.rollout.router import get_router_handle

    path = tmp / f"router-{policy}-{time.monotonic_ns()}.yaml"
    path.write_text("router_class: rollout_ext.verl.router.TailAwareRouterActor\n"
                    f"policy: {policy}\nchunk_tokens: {chunk_tokens}\nslots_per_replica: {slots}\n{extra}")
    servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
    return get_router_handle(servers, router_config_path=str(path))


def make_client(config, router, eos_id: int = 1):
    from rollout_ext.verl.continuation import ChunkedLLMServerClient

    return ChunkedLLMServerClient(config, router, eos_token_ids=[eos_id])


def sampling_params(job: dict, cap: int, eos_id: int = 1) -> dict:
    if job["length"] is None:  # arith: the model decides, from this sample's own random stream (if seeded)
        seed = {"seed": job["seed"]} if job.get("seed") is not None else {}
        return {"temperature": 1.0, **seed, "max_tokens": cap, "logprobs": True}
    return {"temperature": 0.0, "max_tokens": cap, "logprobs": True,
            "extra_args": {"eos_at_total": len(job["prompt_ids"]) + job["length"], "eos_id": eos_id}}


async def rollout(client, jobs: list[dict], cap: int) -> dict:
    """All jobs at once; returns makespan and per-request outputs."""
    t0 = time.perf_counter()
    finish_s: dict[str, float] = {}

    async def one(job):
        out = await client.generate(job["request_id"], prompt_ids=job["prompt_ids"],
                                    sampling_params=sampling_params(job, cap))
        finish_s[job["request_id"]] = time.perf_counter() - t0
        return out

    outs = await asyncio.gather(*(one(j) for j in jobs))
    return {"makespan_s": max(finish_s.values()), "outputs": outs, "finish_s": finish_s}


# ---- the benchmark ----------------------------------------------------------------------------------
def run_real(a) -> dict:
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="balance_real-"))
    slow_dir = tmp / "slow_steps" if a.slow_ms > 0 else None
    config, manager = start_replicas(a, slow_dir)
    results = []
    try:
        slow_replica = slow_one_replica(manager, slow_dir, a.slow_ms) if slow_dir else None
        measured = make_jobs(a, epoch=0)
        # forced: the drawn lengths. arith: the first measured run's, which every later run must repeat
        # (the same seeds), so that every policy decodes the same batch.
        expected = [j["length"] for j in measured] if a.workload == "forced" else None

        # Warm the engines (first steps compile and allocate) so the first policy is not penalised.
        asyncio.run(rollout(make_client(config, make_router(manager, "verl_default", a.chunk_tokens,
                                                            a.max_num_seqs, tmp)),
                            make_jobs(a, epoch=-99)[: 2 * a.replicas], a.cap))

        def measure(name: str, policy: str, chunk_tokens: int) -> dict:
            """A fresh router: warm-up epochs (predictor history), then the measured batch."""
            router = make_router(manager, policy, chunk_tokens, a.max_num_seqs, tmp)
            client = make_client(config, router)
            for warm in range(a.warm_epochs):
                asyncio.run(rollout(client, make_jobs(a, epoch=-1 - warm), a.cap))
                ray.get(router.end_epoch.remote())
            cpu0_s = ray.get(router.get_status.remote())["router_cpu_s"]
            run = asyncio.run(rollout(client, measured, a.cap))
            status = ray.get(router.get_status.remote())
            ray.kill(router)
            outs = run["outputs"]
            nonlocal expected
            if expected is None:
                expected = [len(o.token_ids) for o in outs]
            longest = max(zip(measured, expected), key=lambda pair: pair[1])[0]
            return {
                "policy": name, "makespan_s": run["makespan_s"],
                "longest_finish_s": run["finish_s"][longest["request_id"]], "moves": status["policy"]["moves"],
                "moved_sequences": sum(len(set(o.extra_fields.get("continuation_replicas", ()))) > 1 for o in outs),
                "chunks": sum(o.extra_fields.get("continuation_chunks", 1) for o in outs),
                # The router round trip at a boundary, as the client saw it (release, then acquire).
                "boundary_acquire_ms": _per_boundary_ms(outs),
                "boundary_gap_ms": status["policy"].get("boundary_gap_ms"),  # what the policy saw
                "boundary_ms": status["policy"].get("boundary_ms"),  # gap + the fitted per-chunk cost
                "replica_slowdown": status["policy"].get("replica_slowdown"),  # each replica's, beside the others
                "replica_speed_evidence": status["policy"].get("replica_speed_evidence"),  # what it rests on
                "router_cpu_s": round(status["router_cpu_s"] - cpu0_s, 3),  # the measured batch only
                "wrong_lengths": sum(len(o.token_ids) != n for n, o in zip(expected, outs)),
                "predictor": status["policy"].get("predictor"),
            }

        rows = [(policy, policy, a.chunk_tokens) for policy in a.policy_list]
        if not a.no_unchunked:
            # Whole sequences, no continuation: what chunking costs, and placement order alone.
            rows.append((NOISE_ROW, "verl_default", 0))
            if "tail_aware" in a.policy_list:
                rows.append(("tail_aware_unchunked", "tail_aware", 0))
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
        for rep in range(a.repeats):
            # Alternate the order so that drifting load on the machine hits every policy alike.
            for name, policy, chunk_tokens in (rows if rep % 2 == 0 else rows[::-1]):
                runs[name].append(measure(name, policy, chunk_tokens))
                print(f"repeat {rep + 1}/{a.repeats} {name}: {runs[name][-1]['makespan_s']:.2f} s, "
                      f"{runs[name][-1]['chunks']} chunks", flush=True)
        for name, policy, chunk_tokens in rows:
            reps = runs[name]
            spans = sorted(r["makespan_s"] for r in reps)
            results.append({
                "policy": name, "router_policy": policy, "chunk_tokens": chunk_tokens, "replicas": a.replicas,
                "makespan_s": round(float(np.median(spans)), 3), "makespan_runs_s": [round(r["makespan_s"], 3) for r in reps],
                "longest_finish_s": round(float(np.median([r["longest_finish_s"] for r in reps])), 3),
                "moves": sum(r["moves"] for r in reps), "moved_sequences": sum(r["moved_sequences"] for r in reps),
                "chunks": reps[-1]["chunks"], "boundary_acquire_ms": [r["boundary_acquire_ms"] for r in reps],
                "boundary_gap_ms": [r["boundary_gap_ms"] for r in reps],
                "boundary_ms": [r["boundary_ms"] for r in reps],
                "router_cpu_s": [r["router_cpu_s"] for r in reps],
                "replica_slowdown": [r["replica_slowdown"] for r in reps],
                "replica_speed_evidence": [r["replica_speed_evidence"] for r in reps],
                "wrong_lengths": sum(r["wrong_lengths"] for r in reps),
                "predictor": reps[-1]["predictor"],
            })
    finally:
        ray.shutdown()
    lengths = expected
    by = {r["policy"]: r for r in results}
    base = by.get("verl_default")
    for r in results:
        r["ratio_vs_verl_default"] = round(r["makespan_s"] / base["makespan_s"], 3) if base else None
        r.update(paired_ratios(r["makespan_runs_s"], base["makespan_runs_s"]) if base else {})
    return {
        "setup": {
            "workload": a.workload, "model": a.model, "replicas": a.replicas, "prompts": a.prompts,
            "samples": a.samples,
            "lengths": {"min": min(lengths), "p50": float(np.percentile(lengths, 50)),
                        "p90": float(np.percentile(lengths, 90)), "max": max(lengths),
                        "mean": round(float(np.mean(lengths)), 1), "sum": int(sum(lengths)),
                        "at_cap": sum(n >= a.cap for n in lengths)},
            "cap": a.cap, "chunk_tokens": a.chunk_tokens, "max_num_seqs": a.max_num_seqs,
            "warm_epochs": a.warm_epochs, "repeats": a.repeats, "seed": a.seed,
            # added to every decode step of one replica (0: all equal)
            "slow_replica": {"address": slow_replica, "step_ms": a.slow_ms} if slow_dir else None,
            "length_control": WORKLOADS[a.workload][1] + "; the router sees only prompt ids and the cap",
            "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                        "cpus": _cpus()},
        },
        "results": results,
    }


def paired_ratios(runs_s: list[float], base_runs_s: list[float]) -> dict:
    """Each repeat's makespan over verl_default's in the same repeat: the median and the range.

    Rows of one repeat run back to back, so a slow spell of the machine hits both sides of a pair;
    the ratio of medians mixes repeats. `verl_default_unchunked` runs the same thing as
    `verl_default`, so its range is the noise floor of this measure.
    """
    ratios = sorted(repeat_ratios(runs_s, base_runs_s))
    return {"paired_ratio_median": round(float(np.median(ratios)), 3),
            "paired_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)]}


def repeat_ratios(runs_s: list[float], base_runs_s: list[float]) -> list[float]:
    """Each repeat's makespan over the base row's in the same repeat."""
    return [a / b for a, b in zip(runs_s, base_runs_s, strict=True)]


def _per_boundary_ms(outs) -> float | None:
    boundaries = sum(o.extra_fields.get("continuation_chunks", 1) - 1 for o in outs)
    total_s = sum(o.extra_fields.get("continuation_boundary_acquire_s", 0.0) for o in outs)
    return round(1e3 * total_s / boundaries, 2) if boundaries else None


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def plot(out: dict, path: str) -> None:
    """Every repeat's makespan over verl_default's in the same repeat, one column per row; the median
    as a bar. The unchunked verl_default row runs the same policy: its spread is the noise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in out["results"] if r["policy"] == "verl_default"), None)
    if base is None:
        raise SystemExit("--plot needs a verl_default row: every ratio is over it")
    rows = [r for r in out["results"] if r["policy"] != "verl_default"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows) + 2), 4.5))
    for x, r in enumerate(rows):
        ratios = repeat_ratios(r["makespan_runs_s"], base["makespan_runs_s"])
        median = float(np.median(ratios))
        color = "tab:gray" if r["policy"] == NOISE_ROW else "tab:blue"
        ax.bar(x, median, width=0.6, color=color, alpha=0.35)
        ax.scatter([x] * len(ratios), ratios, color=color, zorder=3, s=18)
        ax.annotate(f"{median:.3f}", (x, max(ratios)), xytext=(0, 4), textcoords="offset points",
                    ha="center", fontsize=9)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", zorder=0)
    ax.set_xticks(range(len(rows)), [r["policy"] + ("\n(noise floor)" if r["policy"] == NOISE_ROW else "")
                                     for r in rows], fontsize=8)
    ax.set_ylabel("makespan / verl_default's, same repeat")
    setup = out["setup"]
    slow = setup.get("slow_replica")
    ax.set_title(f"{setup['replicas']} real vLLM CPU replicas, {setup['prompts']}x{setup['samples']} prompts, "
                 f"{setup['repeats']} repeats, chunk {setup['chunk_tokens']}"
                 + (f"\none replica +{slow['step_ms']:g} ms per step" if slow else ", equal replicas"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.replot:
        out = json.loads(Path(a.replot).read_text())
    else:
        out = run_real(a)
        report(out)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        plot(out, a.plot)
        print("plot:", a.plot)
    return out


def report(out: dict) -> None:
    """The run's setup, one line per row, and the speed each row learned for a slowed replica."""
    print(json.dumps(out["setup"], indent=1))
    print(f"{'policy':<24} {'makespan_s':>10} {'vs_verl':>8} {'paired (range)':>22} {'moves':>6} {'chunks':>7} "
          f"{'wrong_len':>9}  runs_s  (boundary acquire ms; boundary cost the policy fitted, ms; router CPU s; per run)")
    for r in out["results"]:
        low, high = r.get("paired_ratio_range") or (0, 0)
        paired = f"{r.get('paired_ratio_median') or 0:.3f} ({low:.3f}-{high:.3f})"
        print(f"{r['policy']:<24} {r['makespan_s']:>10.2f} {r['ratio_vs_verl_default'] or 0:>8.3f} {paired:>22} "
              f"{r['moves']:>6} {r['chunks']:>7} {r['wrong_lengths']:>9}  {r['makespan_runs_s']}"
              f"  {r['boundary_acquire_ms']}  {r['boundary_ms']}  {r['router_cpu_s']}")
    slow = out["setup"]["slow_replica"]
    if slow:
        print(f"\nslow replica {slow['address']} (+{slow['step_ms']:g} ms per step); learned speed per run:")
        for r in out["results"]:
            learned = [(s or {}).get(slow["address"]) for s in r["replica_slowdown"]]
            others = [max((v for k, v in (s or {}).items() if k != slow["address"]), default=None)
                      for s in r["replica_slowdown"]]
            print(f"  {r['policy']:<24} slow replica {learned}, fastest other {others}")


if __name__ == "__main__":
    main()
