"""Run real vLLM greedy decoding in a fresh process and return tokens, top-k log-probs and its log.

Equivalence tests compare two such runs (plugin modules on vs. off). A fresh process per run keeps
each configuration honest: the plugin registers from that process's environment alone, exactly as
it does in a deployed engine.

Child entry: `python -m rollout_ext.testing.greedy --spec JSON --out PATH`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout_ext.config import PREFIX, environ_copy

KV_CACHE_BYTES = 256 * 2**20


@dataclass
class GreedySpec:
    model: str
    prompts: list[list[int]]
    max_tokens: int = 16
    tp: int = 1
    enforce_eager: bool = True
    dtype: str = "float32"
    top_logprobs: int = 5
    max_num_batched_tokens: int | None = None
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True
    # Collect rope gather counters from every worker (rollout_ext.testing.rope_probe).
    rope_counters: bool = True
    # Run vLLM's EngineCore in this run's process (VLLM_ENABLE_V1_MULTIPROCESSING=0); at TP=1 the
    # worker runs there too. Each vLLM process costs ~10 s of imports on a 2-core CPU, so a TP=1
    # run takes ~17 s instead of ~45 s. Outputs are the same; only a test of which processes load
    # the plugin needs the deployed layout (False).
    engine_in_process: bool = True


@dataclass
class GreedyResult:
    tokens: list[list[int]]
    # Per request, per step: {token_id: logprob} of the top-k candidates.
    logprobs: list[list[dict[int, float]]]
    # The child's stdout and stderr together: vLLM logs to stdout, Python warnings go to stderr.
    log: str = field(repr=False, default="")
    # Per worker: rope gather counters (see rope_probe.read), or {"error": ...}; None if not asked.
    rope_counters: list[dict] | None = None
    # vLLM's speculative decoding counters: drafts, draft_tokens, accepted_tokens (all 0 without drafting).
    spec_decode: dict[str, int] = field(default_factory=dict)


def child_env(env: dict[str, str], spec: GreedySpec) -> dict[str, str]:
    """This process's environment without plugin switches, plus `env` (the run's whole config)."""
    base = {k: v for k, v in environ_copy().items() if not k.startswith(PREFIX) and k != "VLLM_PLUGINS"}
    # TP=2 on CPU needs one core per rank; otherwise keep the caller's binding.
    base["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if spec.tp == 2 else base.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    base["PYTHONUNBUFFERED"] = "1"
    base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if spec.engine_in_process else "1"
    # vLLM 0.27.1 with torch 2.13 saves AOT-compiled models that it cannot load back ("'function'
    # object has no attribute 'finalize_loading'") and recompiles every run; without AOT the
    # inductor cache hits, and a warm compiled start takes ~4 s instead of ~9 s.
    base.setdefault("VLLM_USE_AOT_COMPILE", "0")
    base.update(env)
    return base


def run_greedy(spec: GreedySpec, env: dict[str, str], timeout_s: float = 600) -> GreedyResult:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "rollout_ext.testing.greedy", "--spec", json.dumps(asdict(spec)), "--out", str(out)]
        run_env = dict(env)
        if spec.rope_counters:
            # collective_rpc sends the probe functions to the workers with cloudpickle.
            run_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        proc = subprocess.run(
            cmd, env=child_env(run_env, spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
        )
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.splitlines()[-40:])
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}) with env {env}:\n{tail}")
        data = json.loads(out.read_text())
    logprobs = [[{int(t): lp for t, lp in step.items()} for step in req] for req in data["logprobs"]]
    return GreedyResult(
        tokens=data["tokens"], logprobs=logprobs, log=proc.stdout, rope_counters=data.get("rope_counters"),
        spec_decode=data["spec_decode"],
    )


def _generate(spec: GreedySpec) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=spec.model,
        tensor_parallel_size=spec.tp,
        dtype=spec.dtype,
        enforce_eager=spec.enforce_eager,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        skip_tokenizer_init=True,
        max_model_len=spec.max_model_len,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        seed=0,
        disable_log_stats=False,  # the speculative decoding counters
    )
    if spec.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    llm = LLM(**kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True, logprobs=spec.top_logprobs, detokenize=False
    )
    probe_error = _rpc(llm, "install") if spec.rope_counters else None
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec.prompts], params, use_tqdm=False)
    tokens, logprobs = [], []
    for request in outputs:
        completion = request.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append([{str(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs])
    result = {"tokens": tokens, "logprobs": logprobs, "spec_decode": spec_decode_counts(llm.get_metrics())}
    if spec.rope_counters:
        counters = _rpc(llm, "read")
        result["rope_counters"] = counters if probe_error is None else probe_error
    return result


def spec_decode_counts(metrics) -> dict[str, int]:
    """vLLM's counters vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens} among `metrics`
    (`LLM.get_metrics()`, or `vllm.v1.metrics.reader.get_metrics_snapshot()` in a server), summed."""
    counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name in counts:
            counts[name] += int(metric.value)
    return counts


def _rpc(llm, name: str):
    """Run rope_probe.<name> on every worker; a failure is recorded, not raised (counters are
    diagnostics and must not fail a run)."""
    from rollout_ext.testing import rope_probe

    try:
        found = llm.collective_rpc(getattr(rope_probe, name))
    except Exception as e:  # noqa: BLE001 - any worker failure becomes a recorded error
        return [{"error": f"{type(e).__name__}: {e}"}]
    return None if name == "install" else found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = GreedySpec(**json.loads(args.spec))
    Path(args.out).write_text(json.dumps(_generate(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
