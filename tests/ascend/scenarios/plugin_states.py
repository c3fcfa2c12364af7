"""The plugin's register() with vllm-ascend importable. Run: plugin_states.py (env carries the
ROLLOUT_EXT_* switches). Prints the status line and one JSON line of module states; a strict
refusal propagates as the PatchError the engine start would see."""

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")

from rollout_ext import plugin  # noqa: E402

plugin.register()
states = {name: {"state": s.state, "stack": s.stack, "detail": s.detail} for name, s in plugin.module_states().items()}
print("STATES " + json.dumps(states), flush=True)
plugin.unregister()
