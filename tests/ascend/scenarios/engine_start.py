"""Start a real vLLM engine (the tiny Qwen2, CPU) with vllm-ascend importable. Run:
engine_start.py MODEL_DIR [--no-chunked-prefill] (env carries VLLM_PLUGINS=rollout_ext and the ROLLOUT_EXT_* switches).
Prints "ENGINE STARTED" or "ENGINE FAILED <exception type>: <message>" (exit code 0 either way, so
the test reads what the user would see)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

import os  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402


def world_group_class(_worker=None) -> str:
    """Runs in the worker: whose GroupCoordinator its world group is (vllm-ascend patches it)."""
    from vllm.distributed import parallel_state

    group_class = type(parallel_state.get_world_group())
    return f"{group_class.__module__}.{group_class.__name__}"


# vLLM spawns its engine core and worker: they import this file again, and must not start engines.
if __name__ == "__main__":
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc ships world_group_class
    try:
        llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=256,
                  max_num_batched_tokens=256, max_num_seqs=4, kv_cache_memory_bytes=64 * 2**20,
                  enable_chunked_prefill="--no-chunked-prefill" not in sys.argv[2:])
    except Exception as e:  # what the user's launch script would see
        print(f"ENGINE FAILED {type(e).__name__}: {e}", flush=True)
    else:
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
        print(f"ENGINE STARTED; generated {len(outputs[0].outputs[0].token_ids)} tokens; world group "
              f"{llm.collective_rpc(world_group_class)[0]}", flush=True)
