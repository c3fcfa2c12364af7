"""The vllm-ascend bindings' guards against one vllm-ascend source tree. Run: guards.py UPSTREAM.

Imports vllm-ascend from UPSTREAM under the lane and runs each binding's guard: `check_upstream()`
for the Ascend bindings and tail drafting, `require_vllm_linear_forward` for the modules that reach
vllm-ascend's linears through vLLM's forward.
Prints one JSON line: binding patch name -> null when its guard passes, or the PatchError message.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter(sys.argv[1])

from rollout_ext.patches import PatchError, load  # noqa: E402
from rollout_ext.patches._ascend import require_vllm_linear_forward  # noqa: E402

GUARDS = {"rope_cache_ascend": lambda: load("rope_cache_ascend").check_upstream(),
          "mc2_ascend": lambda: load("mc2_ascend").check_upstream(),
          "flashcomm": lambda: require_vllm_linear_forward("flashcomm"),
          "mlp_only_tp": lambda: require_vllm_linear_forward("mlp_only_tp"),
          "tail_drafting": lambda: load("tail_drafting").check_upstream()}
results = {}
for name, guard in GUARDS.items():
    try:
        guard()
        results[name] = None
    except PatchError as e:
        results[name] = str(e)
print("GUARDS " + json.dumps(results), flush=True)
