"""Start a real vLLM engine (the tiny Qwen2, CPU) with vllm-ascend importable. Run:
engine_start.py MODEL_DIR (env carries VLLM_PLUGINS=rollout_ext and the ROLLOUT_EXT_* switches).
Prints "ENGINE STARTED" or "ENGINE FAILED <exception type>: <message>" (exit code 0 either way, so
the test reads what the user would see)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

from vllm import LLM  # noqa: E402

try:
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=256,
              max_num_batched_tokens=256, max_num_seqs=4, kv_cache_memory_bytes=64 * 2**20)
except Exception as e:  # what the user's launch script would see
    print(f"ENGINE FAILED {type(e).__name__}: {e}", flush=True)
else:
    print("ENGINE STARTED", flush=True)
