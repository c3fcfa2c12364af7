"""The vllm-ascend bindings' guards against one vllm-ascend source tree. Run: guards.py UPSTREAM.

Imports vllm-ascend from UPSTREAM under the lane and runs each binding's `check_upstream()`.
Prints one JSON line: binding patch name -> null when its guard passes, or the PatchError message.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter(sys.argv[1])

from rollout_ext.patches import PatchError, load  # noqa: E402

results = {}
for name in ("rope_cache_ascend", "mc2_ascend"):
    try:
        load(name).check_upstream()
        results[name] = None
    except PatchError as e:
        results[name] = str(e)
print("GUARDS " + json.dumps(results), flush=True)
