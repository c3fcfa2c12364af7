"""The rollout_ext backend resolves through both of verl's registries, loaded either way verl offers.

Each loading mode runs in a fresh interpreter, because registration happens during `import verl`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import verl
out = {
    "plugin_loaded": "rollout_ext.verl" in sys.modules,
    "vllm_imported": "vllm" in sys.modules,
    "replica_module_imported": "verl.workers.rollout.replica" in sys.modules,
}
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
out["replica_registered"] = "rollout_ext" in RolloutReplicaRegistry._registry
out["adapter"] = _ROLLOUT_REGISTRY.get(("rollout_ext", "async"))
out["vllm_adapter"] = _ROLLOUT_REGISTRY.get(("vllm", "async"))
if out["plugin_loaded"]:
    import rollout_ext.verl as plugin
    from verl.workers.config.rollout import RolloutConfig
    plugin.register()
    import importlib; importlib.reload(plugin)  # a second load must change nothing
    wrapped = RolloutConfig.__post_init__
    out["post_init_wraps"] = 0
    while hasattr(wrapped, "__wrapped__"):
        out["post_init_wraps"] += 1
        wrapped = wrapped.__wrapped__
print("PROBE" + json.dumps(out))
"""


def run_probe(env_overrides: dict[str, str]) -> dict:
    from rollout_ext.config import environ_copy

    env = {**environ_copy(), **env_overrides}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE"))
    return json.loads(line[len("PROBE") :])


@pytest.mark.parametrize(
    "env",
    [
        {"VERL_USE_EXTERNAL_PLUGINS": "auto"},
        {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "rollout_ext.verl"},
        {"VERL_USE_EXTERNAL_PLUGINS": "rollout_ext", "VERL_USE_EXTERNAL_MODULES": "rollout_ext.verl"},
    ],
    ids=["entry_point", "external_modules", "both"],
)
def test_registers_lazily_and_once(env):
    out = run_probe(env)
    assert out["plugin_loaded"]
    # Registration itself imports neither vLLM nor verl's replica module.
    assert not out["vllm_imported"] and not out["replica_module_imported"]
    assert out["replica_registered"]
    assert out["adapter"] == out["vllm_adapter"] == "verl.workers.rollout.vllm_rollout.ServerAdapter"
    assert out["post_init_wraps"] == 1


def test_not_registered_when_plugins_are_off():
    out = run_probe({"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""})
    assert not out["plugin_loaded"] and not out["replica_registered"] and out["adapter"] is None
