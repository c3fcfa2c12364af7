"""The patch registry: name -> module with apply(cfg) and revert(). Nothing patches on import.

`rollout_ext.plugin.register()` is the one call site; it applies, in this order, what the config
enables. Modules are imported only when applied, so an unused patch never imports its upstream code.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rollout_ext.patches._base import PatchError, SUPPORTED_VLLM

__all__ = ["PATCHES", "PatchError", "SUPPORTED_VLLM", "load", "selected"]

# Application order matters: vllm-ascend's own patches first, then the engine check, then models.
PATCHES = {
    "ascend_import_order": "rollout_ext.patches.ascend_import_order",
    "engine_config_check": "rollout_ext.patches.engine_config_check",
    "rope_cache": "rollout_ext.patches.rope_cache",
    "mc2_row_parallel": "rollout_ext.patches.mc2_row_parallel",
    "flashcomm": "rollout_ext.patches.flashcomm",
    "mlp_only_tp": "rollout_ext.patches.mlp_only_tp",
    "fav2_attention": "rollout_ext.patches.fav2_attention",
}

# Config module switch -> patch name.
MODULE_PATCHES = {
    "rope_cache": "rope_cache",
    "mc2": "mc2_row_parallel",
    "flashcomm": "flashcomm",
    "mlp_only_tp": "mlp_only_tp",
    "fav2": "fav2_attention",
}

ALWAYS = ("ascend_import_order", "engine_config_check")


def load(name: str) -> ModuleType:
    if name not in PATCHES:
        raise KeyError(f"unknown rollout_ext patch {name!r}; known: {', '.join(PATCHES)}")
    return importlib.import_module(PATCHES[name])


def selected(cfg) -> list[str]:
    """Patch names to apply for this config, in application order."""
    wanted = set(ALWAYS) | {MODULE_PATCHES[m] for m in cfg.active_modules}
    return [name for name in PATCHES if name in wanted]
