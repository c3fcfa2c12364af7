"""DAPO-style rollout on CPU with rollout.name=rollout_ext: 2 replicas, rule reward, dynamic sampling.

This is the rollout half of verl's DAPO step, run for real: verl's LLMServerManager starts
`rollout_ext` replicas (vLLM CPU engines with the rollout_ext plugin), verl's AgentLoopManager
generates each batch, examples/arith_reward.py scores it, DAPO's overlong penalty is applied, and
groups whose `acc` does not vary are filtered out (algorithm.filter_groups), drawing more prompts
until the batch is full. The actor update is not run: see docs/verl.md for why CPU training stops.

Run through examples/dapo_tiny_cpu.sh (it sets the environment Ray needs to stay on 127.0.0.1).
Writes a JSON report: plugin lines per replica, per-iteration metrics with rollout timing, and with
--profile-rollout DIR the rollout-phase traces of step 1 (verl's rollout profiler, replica 0).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PLUGIN_MARK = "rollout_ext 0.1.0: device="


def dapo_overrides(args, data_dir: Path) -> list[str]:
    from rollout_ext.verl.tiny_run import rollout_overrides

    return [
        *rollout_overrides(args.model, replicas=args.replicas, tp=args.tp, response_length=args.response_length,
                           rollout_n=args.n),
        "trainer.use_v1=True",
        "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        f"algorithm.filter_groups.max_num_gen_batches={args.max_gen_batches}",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={args.prompts_per_step}",
        "reward.reward_manager.name=dapo",
        f"reward.custom_reward_function.path={REPO / 'examples' / 'arith_reward.py'}",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        f"+reward.reward_kwargs.overlong_buffer_cfg.len={args.overlong_buffer}",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
        f"+reward.reward_kwargs.max_resp_len={args.response_length}",
    ]


def overlong_penalty(response_len: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: linear from 0 at max-buffer to -factor at max."""
    expected_len = max_resp_len - buffer_len
    return min(-(response_len - expected_len) / buffer_len * factor, 0.0)


def plugin_lines(servers) -> list[list[str]]:
    """The plugin's log lines written by each server actor and its vLLM child processes."""
    import os

    import ray

    logs_dir = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    found = []
    for server in servers:
        pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
        lines = []
        for path in sorted(logs_dir.glob(f"worker-*-{pid}.*")):
            lines += [line.strip() for line in path.read_text(errors="replace").splitlines() if PLUGIN_MARK in line]
        found.append(lines)
    return found


def make_batch(rows, n: int):
    from verl import DataProto

    raw_prompt, ground_truth, uids = [], [], []
    for row in rows:
        uid = uuid.uuid4().hex
        for _ in range(n):
            raw_prompt.append(list(row["prompt"]))
            ground_truth.append(row["reward_model"]["ground_truth"])
            uids.append(uid)
    return DataProto.from_dict(non_tensors={
        "raw_prompt": np.array(raw_prompt + [None], dtype=object)[:-1],
        "data_source": np.array(["arith"] * len(uids), dtype=object),
        "ground_truth": np.array(ground_truth, dtype=object),
        "uid": np.array(uids, dtype=object),
    })


def score(batch, tokenizer, config) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """(reward, acc, per-sample checks) with the example's rule reward and DAPO's overlong penalty."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arith_reward", config.reward.custom_reward_function.path)
    reward_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward_module)
    kwargs = config.reward.reward_kwargs
    buffer = kwargs.overlong_buffer_cfg
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    log_probs = batch.batch["rollout_log_probs"]
    rewards, accs, checks = [], [], []
    for i in range(len(batch)):
        length = int(mask[i].sum())
        ids = responses[i][:length].tolist()
        result = reward_module.compute_score("arith", tokenizer.decode(ids), batch.non_tensor_batch["ground_truth"][i])
        reward = result["score"]
        if buffer.enable:
            reward += overlong_penalty(length, kwargs.max_resp_len, buffer.len, buffer.penalty_factor)
        rewards.append(reward)
        accs.append(result["acc"])
        valid = log_probs[i][:length]
        checks.append({
            "response_tokens": length,
            "log_probs_finite": bool(length > 0 and all(math.isfinite(x) and x <= 0 for x in valid.tolist())),
        })
    return np.array(rewards), np.array(accs), checks


def kept_groups(uids: np.ndarray, acc: np.ndarray) -> list[str]:
    """DAPO dynamic sampling: keep a group only if its samples disagree on the metric."""
    keep = []
    for uid in dict.fromkeys(uids.tolist()):
        values = acc[uids == uid]
        if values.std() > 0 or len(values) == 1:
            keep.append(uid)
    return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / ".cache/models/tiny-qwen2"))
    parser.add_argument("--data-dir", default=str(REPO / ".cache/data/arith"))
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of each replica")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (DAPO group size)")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--overlong-buffer", type=int, default=8)
    parser.add_argument("--max-gen-batches", type=int, default=3)
    parser.add_argument("--report", default=str(REPO / "out/dapo_tiny_cpu.json"))
    parser.add_argument("--profile-rollout", metavar="DIR",
                        help="trace step 1's rollout on replica 0 (verl's rollout profiler, torch/npu tool)")
    args = parser.parse_args()
    started = time.perf_counter()
    started_wall = time.time()

    import pandas as pd

    from rollout_ext.verl.tiny_run import compose, init_local_ray, write_arith_parquet

    data_dir = Path(args.data_dir)
    write_arith_parquet(data_dir / "train.parquet", 64)
    write_arith_parquet(data_dir / "val.parquet", 8, seed=1)
    overrides = dapo_overrides(args, data_dir)
    if args.profile_rollout:
        from rollout_ext.verl.profiling import phase_overrides

        overrides += phase_overrides("rollout", Path(args.profile_rollout).resolve())
    config = compose(overrides)
    init_local_ray(args.replicas * args.tp, cache_env(REPO))

    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.utils import hf_tokenizer
    from verl.workers.rollout.llm_server import LLMServerManager

    t0 = time.perf_counter()
    servers = LLMServerManager.create(config, worker_group=None)
    start_s = time.perf_counter() - t0
    agent_loops = AgentLoopManager.create(config, llm_client=servers.get_client())
    tokenizer = hf_tokenizer(args.model)
    report = {
        "replica_classes": sorted({type(r).__name__ for r in servers.rollout_replicas}),
        "server_addresses": servers.server_addresses,
        "replica_start_s": round(start_s, 1),
        "plugin_lines": plugin_lines([r.servers[0] for r in servers.rollout_replicas]),
        "iterations": [],
    }

    prompts = pd.read_parquet(data_dir / "train.parquet").to_dict("records")
    cursor = 0
    for step in range(args.iterations):
        kept, gen_batches, rollout_s, samples, tokens, checks = [], 0, 0.0, 0, 0, []
        rewards_all, batch_rollout_s, reward_s, slowest_sample_s = [], [], 0.0, 0.0
        while len(kept) < args.prompts_per_step and gen_batches < args.max_gen_batches:
            rows = [prompts[(cursor + i) % len(prompts)] for i in range(args.prompts_per_step)]
            cursor += args.prompts_per_step
            batch = make_batch(rows, args.n)
            profiling = bool(args.profile_rollout) and step == 0 and gen_batches == 0
            if profiling:
                servers.start_profile()  # engine-side: replicas picked by the profiler ranks
            t0 = time.perf_counter()
            output = agent_loops.generate_sequences(batch)
            batch_rollout_s.append(round(time.perf_counter() - t0, 2))
            rollout_s += batch_rollout_s[-1]
            slowest = output.meta_info["timing"]["agent_loop/slowest/generate_sequences"]
            slowest_sample_s = max(slowest_sample_s, float(slowest))
            if profiling:
                servers.stop_profile()
            gen_batches += 1
            t0 = time.perf_counter()
            reward, acc, batch_checks = score(output, tokenizer, config)
            reward_s += time.perf_counter() - t0
            checks += batch_checks
            rewards_all += reward.tolist()
            samples += len(output)
            tokens += int(output.batch["response_mask"].sum())
            kept += kept_groups(output.non_tensor_batch["uid"], acc)
        kept = kept[: args.prompts_per_step]
        report["iterations"].append({
            "step": step + 1,
            "timing_s/rollout": round(rollout_s, 2),
            "timing_s/rollout_per_gen_batch": batch_rollout_s,
            "timing_s/slowest_sample": round(slowest_sample_s, 2),
            "timing_s/reward": round(reward_s, 3),
            "rollout/gen_batches": gen_batches,
            "rollout/samples": samples,
            "rollout/response_tokens": tokens,
            "rollout/tokens_per_s": round(tokens / rollout_s, 2),
            "reward/mean": round(float(np.mean(rewards_all)), 4),
            "filter_groups/kept_groups": len(kept),
            "checks": checks,
        })
        print(json.dumps({k: v for k, v in report["iterations"][-1].items() if k != "checks"}), flush=True)

    if args.profile_rollout:
        report["rollout_traces"] = sorted(
            str(p) for p in Path(args.profile_rollout).rglob("*") if p.is_file() and p.stat().st_mtime >= started_wall
        )
    report["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=1))
    print(f"report: {args.report} (wall {report['wall_s']} s)")
    import ray

    ray.shutdown()


def cache_env(repo: Path) -> dict[str, str]:
    """Keep vLLM and inductor caches in the repository, and stay offline."""
    return {
        "VLLM_CACHE_ROOT": str(repo / ".cache/vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(repo / ".cache/inductor"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


if __name__ == "__main__":
    main()
