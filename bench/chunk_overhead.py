"""What a chunk boundary costs on a real vLLM engine: resuming a sequence on its replica (prefix-cache
hit) and after a move (no cache: the whole context is prefilled again), against one decode step.

A boundary ends the sequence's request and starts a new one with prompt + generated tokens. On the
replica it ran on, the prefix cache holds all but the last partial block; on another replica
nothing is cached. This bench times the engine's side of that, on one in-process engine:

- decode_token_s: one decode step of a lone sequence, (time of N tokens - time of 1 token) / (N - 1);
- resume_cached_s: the first token of a request for prompt + generated, right after that sequence
  ran on this engine (the next chunk on the same replica);
- resume_moved_s: the same request after `reset_prefix_cache()` (the next chunk after a move);
- fresh_first_token_s: the first token of a prompt of the same length the engine never saw.

Each is the median of --repeats runs, with the spread (max - min). The overheads are resume - decode.
The router's share (the acquire round trip at each boundary) is measured on real replicas by
bench/balance_real.py (`boundary_acquire_ms`). Compare within one run only.

    .venv/bin/python bench/chunk_overhead.py --contexts 128,512,2048 --json out/chunk_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rollout_ext.verl.server_env import CPU_KV_CACHE_BYTES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / ".cache" / "models" / "tiny-qwen2"))
    p.add_argument("--contexts", default="128,512,2048", help="prompt + generated tokens at the boundary")
    p.add_argument("--decode-tokens", type=int, default=64, help="N of the decode-step timing")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        a.context_list = [int(x) for x in a.contexts.split(",") if x.strip()]
    except ValueError:
        p.error(f"--contexts={a.contexts!r}; allowed: a comma-separated list of integers >= 16")
    if not a.context_list or min(a.context_list) < 16:
        p.error(f"--contexts={a.contexts!r}; allowed: a comma-separated list of integers >= 16")
    if a.decode_tokens < 2 or a.repeats < 1:
        p.error(f"--decode-tokens={a.decode_tokens} (>= 2), --repeats={a.repeats} (>= 1) required")
    return a


def _stats(values: list[float]) -> dict:
    return {"median_ms": round(1e3 * statistics.median(values), 3),
            "spread_ms": round(1e3 * (max(values) - min(values)), 3), "runs": len(values)}


def measure(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0,
              enable_prefix_caching=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES,
              max_model_len=max(a.context_list) + a.decode_tokens + 16)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    def timed(ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    timed(prompt(64), 8)  # warm-up: first steps allocate
    rows = []
    for ctx in a.context_list:
        decode, cached, moved, fresh = [], [], [], []
        for _ in range(a.repeats):
            head = prompt(max(1, ctx - a.decode_tokens))
            t1, _ = timed(prompt(len(head)), 1)
            t_n, out = timed(head, a.decode_tokens)
            decode.append((t_n - t1) / (a.decode_tokens - 1))
            context = head + out  # the boundary: prompt + generated
            cached.append(timed(context, 1)[0])
            llm.reset_prefix_cache()
            moved.append(timed(context, 1)[0])
            fresh.append(timed(prompt(len(context)), 1)[0])
        row = {"context_tokens": len(context), "decode_token": _stats(decode), "resume_cached": _stats(cached),
               "resume_moved": _stats(moved), "fresh_first_token": _stats(fresh)}
        step_ms = row["decode_token"]["median_ms"]
        row["overhead_cached_ms"] = round(row["resume_cached"]["median_ms"] - step_ms, 3)
        row["overhead_moved_ms"] = round(row["resume_moved"]["median_ms"] - step_ms, 3)
        rows.append(row)
        print(f"context {row['context_tokens']:>6}: decode {step_ms:8.2f} ms/token | resume cached "
              f"{row['resume_cached']['median_ms']:8.2f} (±{row['resume_cached']['spread_ms'] / 2:.2f}) | moved "
              f"{row['resume_moved']['median_ms']:8.2f} (±{row['resume_moved']['spread_ms'] / 2:.2f}) | fresh "
              f"{row['fresh_first_token']['median_ms']:8.2f} ms", flush=True)
    return {"setup": {"model": a.model, "engine": "vLLM in-process, enforce_eager, prefix caching on",
                      "decode_tokens": a.decode_tokens, "repeats": a.repeats, "cpus": len(os.sched_getaffinity(0)),
                      "machine": platform.processor() or platform.machine()},
            "rows": rows}


def main(argv=None) -> dict:
    a = parse_args(argv)
    out = measure(a)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
        print("json:", a.json)
    return out


if __name__ == "__main__":
    main()
