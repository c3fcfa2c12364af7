"""The patch registry: one record per patch, vLLM side and verl side alike. Nothing patches on import.

Every patch is one file here with a header (what it replaces, why, the upstream range, how to undo
it, when to remove it) and module-level `apply(cfg=None)` / `revert()`. The two sides differ only in
who applies them:
- vLLM side: `rollout_ext.plugin.register()` (the vLLM general plugin) applies the infrastructure
  patches, then, for each module the config enables, the patch that module's record
  (rollout_ext.modules) names for this process's stack;
- verl side: `apply_verl()` (called by the verl plugin, rollout_ext.verl) applies each patch right
  after verl imports its `target`, so registering imports neither vLLM nor verl's workers early.
A patch's apply(cfg) returns the state it leaves this process in (rollout_ext.modules): ACTIVE when
it is in place, INERT when it has nothing to do here (e.g. the CPU patches off CPU). `revert_all()` undoes every applied patch of both sides.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

from rollout_ext import modules
from rollout_ext.patches._base import SUPPORTED_VLLM, PatchError

__all__ = ["INFRASTRUCTURE", "PATCHES", "Patch", "PatchError", "SUPPORTED_VLLM", "apply_verl", "load",
           "revert_all", "selected"]


@dataclass(frozen=True)
class Patch:
    side: str  # "vllm" or "verl"
    target: str | None = None  # verl side: applied right after verl imports this module


PATCHES: dict[str, Patch] = {
    # vLLM infrastructure: vllm-ascend's own patches first, then the one engine-time check, then the
    # CPU fixes (weight sync: a no-op unless the replica is on CPU and synced from a trainer;
    # sampling with drafting: CPU only).
    "ascend_import_order": Patch("vllm"),
    "engine_config_check": Patch("vllm"),
    "cpu_weight_reload": Patch("vllm"),
    "cpu_spec_sampling": Patch("vllm"),
    # vLLM module patches, per stack (see rollout_ext.modules).
    "rope_cache": Patch("vllm"),
    "rope_cache_ascend": Patch("vllm"),
    "mc2_row_parallel": Patch("vllm"),
    "mc2_ascend": Patch("vllm"),
    "flashcomm": Patch("vllm"),
    "mlp_only_tp": Patch("vllm"),
    "fav2_attention": Patch("vllm"),
    "tail_drafting": Patch("vllm"),
    # verl side: where verl 0.9.1 branches on rollout.name == "vllm", rollout_ext takes the vLLM branch.
    "verl_rollout_config_checks": Patch("verl", "verl.workers.config.rollout"),
    "verl_lora_rank_check": Patch("verl", "verl.utils.config"),
    "verl_client_priority": Patch("verl", "verl.workers.rollout.llm_server"),
    "verl_checkpoint_delta": Patch("verl", "verl.checkpoint_engine.base"),
    "verl_pd_replica_class": Patch("verl", "verl.workers.rollout.replica"),
    # verl side: rollout_ext's own behaviour in verl jobs.
    "verl_chunked_client": Patch("verl", "verl.workers.rollout.llm_server"),
    "verl_epoch_end": Patch("verl", "verl.trainer.ppo.v1.trainer_base"),
    "verl_epoch_end_separate": Patch("verl", "verl.experimental.separation.ray_trainer"),
    "verl_epoch_end_fully_async": Patch("verl", "verl.experimental.fully_async_policy.fully_async_rollouter"),
    "verl_phase_log": Patch("verl", "verl.utils.debug"),
    # verl side: training on CPU (VERL_PLATFORM=cpu only; see rollout_ext/verl/cpu_platform.py).
    "verl_cpu_process_group": Patch("verl", "verl.utils.distributed"),
    "verl_cpu_engines": Patch("verl", "verl.workers.engine.fsdp.transformer_impl"),
}

INFRASTRUCTURE = ("ascend_import_order", "engine_config_check", "cpu_weight_reload", "cpu_spec_sampling")
VERL = tuple(name for name, patch in PATCHES.items() if patch.side == "verl")

_verl_scheduled: list[str] = []


def load(name: str) -> ModuleType:
    if name not in PATCHES:
        raise KeyError(f"unknown rollout_ext patch {name!r}; known: {', '.join(PATCHES)}")
    return importlib.import_module(f"{__name__}.{name}")


def selected(cfg, stack: str = "vllm") -> list[str]:
    """vLLM-side patch names to apply for this config on `stack`, in application order (modules
    that do not bind on that stack have no patch)."""
    names = list(INFRASTRUCTURE)
    for module in modules.MODULES:
        patch = module.stacks[stack].patch
        if getattr(cfg, module.name) and patch is not None:
            names.append(patch)
    return names


def apply_verl() -> None:
    """Schedule every verl-side patch for the moment verl imports its target (now, if it has).
    Idempotent."""
    from rollout_ext.verl.hooks import when_imported

    for name in VERL:
        if name in _verl_scheduled:
            continue
        _verl_scheduled.append(name)
        when_imported(PATCHES[name].target, lambda _module, name=name: _apply_scheduled(name))


def _apply_scheduled(name: str) -> None:
    if name in _verl_scheduled:  # revert_all() may have cancelled it before verl got there
        load(name).apply()


def revert_all() -> None:
    """Undo every applied patch, both sides, newest first; verl-side patches not yet applied are
    cancelled. The vLLM plugin's record of what it applied is cleared too."""
    from rollout_ext import plugin

    plugin.unregister()
    _verl_scheduled.clear()
    for name in reversed(PATCHES):
        module = sys.modules.get(f"{__name__}.{name}")
        if module is not None:
            module.revert()
