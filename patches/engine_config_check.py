"""Wraps vllm.engine.arg_utils.EngineArgs.create_engine_config to validate rollout_ext against the engine.

Why: some conflicts depend on engine settings that only exist once vLLM builds its config (FAV2 needs
chunked prefill off; TASK_QUEUE_ENABLE=2 needs eager mode; mc2 and MLP-only TP do nothing at TP=1).
Checking here fails in the launching process, before any engine core or worker starts. It is the
one engine-time hook: before vLLM builds the config it runs each applied patch's own
`prepare_engine_args(cfg, engine_args)` (tail_drafting fills the speculative config); after, each
applied patch's own `check_engine(cfg, vllm_config)` (e.g.
mlp_only_tp refuses an unsupported architecture), keeps the merged config (`engine_config()`), and
tells the plugin, so modules that do nothing at this TP size are reported inert.
Targets: vllm>=0.23,<0.28 (create_engine_config(self, usage_context, headless)). Upstream: none.
Undo: revert().
Remove when vLLM gives plugins a hook at engine-config time.
"""

from __future__ import annotations

import functools
import logging

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._base import Swaps, require_signature, require_vllm

NAME = "engine_config_check"
logger = logging.getLogger("vllm.rollout_ext")
_swaps = Swaps(NAME)
_merged: dict = {"config": None}


def engine_config():
    """The last engine's merged rollout_ext config in this process, or None."""
    return _merged["config"]


def check_engine(cfg, vllm_config):
    """rollout_ext's config merged with the engine's; raises ConfigError on a conflict and
    PatchError when an applied patch refuses this engine (strict)."""
    from rollout_ext import patches, plugin

    merged = cfg.with_engine(
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill),
        enforce_eager=bool(vllm_config.model_config.enforce_eager),
    )
    merged.raise_on_conflicts()
    for warning in merged.warnings():
        logger.warning("rollout_ext: %s", warning)
    for name in plugin.applied_patches():
        patch_check = getattr(patches.load(name), "check_engine", None)
        if patch_check is not None and name != NAME:
            patch_check(merged, vllm_config)
    _merged["config"] = merged
    plugin.note_engine(merged)
    return merged


def prepare_engine_args(cfg, engine_args) -> None:
    """Before vLLM builds its config: each applied patch's own `prepare_engine_args(cfg, engine_args)`
    (e.g. tail_drafting fills the speculative config)."""
    from rollout_ext import patches, plugin

    for name in plugin.applied_patches():
        prepare = getattr(patches.load(name), "prepare_engine_args", None)
        if prepare is not None and name != NAME:
            prepare(cfg, engine_args)


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    require_signature(NAME, original, ["usage_context", "headless"])

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        prepare_engine_args(cfg, self)
        vllm_config = original(self, *args, **kwargs)
        check_engine(cfg, vllm_config)
        return vllm_config

    _swaps.replace(EngineArgs, "create_engine_config", create_engine_config)
    return ACTIVE


def revert() -> None:
    _swaps.revert()
    _merged["config"] = None
