"""Parity patches: where verl 0.9.1 branches on rollout.name == "vllm", rollout_ext takes the vLLM branch.

One module per site (see docs/verl.md for the full list, including the sites handled by subclassing
instead of patching). Each module has TARGET (the verl module it patches), apply() and revert().
`apply_when_imported()` is the one call site: each patch is applied right after verl imports its
target, so registering never imports vLLM or verl's worker modules early.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rollout_ext.verl.hooks import when_imported

PATCHES = (
    "rollout_config_checks",
    "lora_rank_check",
    "client_priority",
    "checkpoint_delta",
    "pd_replica_class",
)

_scheduled = False


def load(name: str) -> ModuleType:
    if name not in PATCHES:
        raise KeyError(f"unknown parity patch {name!r}; known: {', '.join(PATCHES)}")
    return importlib.import_module(f"{__name__}.{name}")


def apply_when_imported() -> None:
    global _scheduled
    if _scheduled:
        return
    _scheduled = True
    for name in PATCHES:
        patch = load(name)
        when_imported(patch.TARGET, lambda _module, patch=patch: patch.apply())


def revert_all() -> None:
    for name in reversed(PATCHES):
        load(name).revert()
