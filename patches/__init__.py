"""The patch registry: name -> module with apply(cfg) and revert(). Nothing patches on import.

`rollout_ext.plugin.register()` is the one call site. It applies the infrastructure patches, then,
for each module the config enables, the patch that module's record (rollout_ext.modules) names for
this process's stack. Modules are imported only when applied, so an unused patch never imports its
upstream code.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rollout_ext import modules
from rollout_ext.patches._base import SUPPORTED_VLLM, PatchError

__all__ = ["INFRASTRUCTURE", "PATCHES", "PatchError", "SUPPORTED_VLLM", "load", "selected"]

PATCHES = {
    # Infrastructure: vllm-ascend's own patches first, then the one engine-time check.
    "ascend_import_order": "rollout_ext.patches.ascend_import_order",
    "engine_config_check": "rollout_ext.patches.engine_config_check",
    # Module patches, per stack (see rollout_ext.modules).
    "rope_cache": "rollout_ext.patches.rope_cache",
    "rope_cache_ascend": "rollout_ext.patches.rope_cache_ascend",
    "mc2_row_parallel": "rollout_ext.patches.mc2_row_parallel",
    "mc2_ascend": "rollout_ext.patches.mc2_ascend",
    "flashcomm": "rollout_ext.patches.flashcomm",
    "mlp_only_tp": "rollout_ext.patches.mlp_only_tp",
    "fav2_attention": "rollout_ext.patches.fav2_attention",
}

INFRASTRUCTURE = ("ascend_import_order", "engine_config_check")


def load(name: str) -> ModuleType:
    if name not in PATCHES:
        raise KeyError(f"unknown rollout_ext patch {name!r}; known: {', '.join(PATCHES)}")
    return importlib.import_module(PATCHES[name])


def selected(cfg, stack: str = "vllm") -> list[str]:
    """Patch names to apply for this config on `stack`, in application order (modules that do
    not bind on that stack have no patch)."""
    names = list(INFRASTRUCTURE)
    for module in modules.MODULES:
        patch = module.stacks[stack].patch
        if getattr(cfg, module.name) and patch is not None:
            names.append(patch)
    return names
