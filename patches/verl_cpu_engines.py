"""Registers verl's FSDP training engines for the `cpu` device.
Replaces: nothing is swapped; `EngineRegistry._engines[model_type][backend]["cpu"]` is added, pointing
at the class registered for "cuda" (FSDPEngineWithLMHead, FSDPEngineWithValueHead).
Why: verl registers its FSDP engines for cuda and npu only (verl/workers/engine/fsdp/
transformer_impl.py:1143,1594), and `EngineRegistry.get_engine_cls` looks them up by
`get_device_name()` (verl/workers/engine/base.py:402-429), which is "cpu" on the CPU platform. The
classes themselves are device-neutral once `get_device_id()` answers "cpu". Use FSDP2
(`actor.strategy=fsdp2`): FSDP1 hard-codes `sync_module_states=True` (transformer_impl.py:437-448),
which needs an accelerator. Applies only with VERL_PLATFORM=cpu.
Targets: verl>=0.9,<0.10. Upstream: none. Undo: revert() removes the added keys.
Remove when verl registers a CPU engine itself.
"""

from __future__ import annotations

from rollout_ext.modules import ACTIVE, INERT
from rollout_ext.patches._verl import require_verl
from rollout_ext.verl import cpu_platform

NAME = "verl_cpu_engines"
BACKENDS = ("fsdp", "fsdp2")
_added: list[tuple[dict, str]] = []


def apply(cfg=None) -> str:
    if _added:
        return ACTIVE
    if not cpu_platform.selected():
        return INERT
    require_verl(NAME)
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (its decorators fill the registry)
    from verl.workers.engine.base import EngineRegistry

    for backends in EngineRegistry._engines.values():
        for backend in BACKENDS:
            registry = backends.get(backend)
            if registry is not None and "cuda" in registry and "cpu" not in registry:
                registry["cpu"] = registry["cuda"]
                _added.append((registry, "cpu"))
    return ACTIVE


def revert() -> None:
    while _added:
        registry, key = _added.pop()
        registry.pop(key, None)
