"""Registers the `rollout_ext` backend in both of verl's registries, lazily.

- `RolloutReplicaRegistry` (verl.workers.rollout.replica): a loader that imports our replica class
  (and with it vLLM) only when a job asks for rollout.name=rollout_ext.
- `_ROLLOUT_REGISTRY[("rollout_ext", "async")]` (verl.workers.rollout.base): the hybrid engine's
  ServerAdapter is verl's vLLM one, since our servers speak the vLLM server protocol.
Both entries are added when verl itself imports those modules (see hooks.py), so `import verl`
stays as fast as without the plugin. The verl-side patches (rollout_ext.patches, side "verl") are
scheduled the same way, and with VERL_PLATFORM=cpu the CPU platform is registered
(rollout_ext/verl/cpu_platform.py).
"""

from __future__ import annotations

from rollout_ext import patches
from rollout_ext.verl import cpu_platform
from rollout_ext.verl.hooks import when_imported
from rollout_ext.verl.names import BACKEND, VLLM_BACKEND

_registered = False


def register() -> None:
    """Idempotent: the entry point and VERL_USE_EXTERNAL_MODULES may both load us."""
    global _registered
    if _registered:
        return
    _registered = True
    cpu_platform.register()
    when_imported("verl.workers.rollout.replica", _add_replica_loader)
    when_imported("verl.workers.rollout.base", _add_server_adapter)
    patches.apply_verl()


def load_replica_class():
    from rollout_ext.verl.replica import RolloutExtReplica

    return RolloutExtReplica


def _add_replica_loader(module) -> None:
    module.RolloutReplicaRegistry.register(BACKEND, load_replica_class)


def _add_server_adapter(module) -> None:
    registry = module._ROLLOUT_REGISTRY
    registry[(BACKEND, "async")] = registry[(VLLM_BACKEND, "async")]
