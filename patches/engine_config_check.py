"""Wraps vllm.engine.arg_utils.EngineArgs.create_engine_config to validate rollout_ext against the engine.

Why: some conflicts depend on engine settings that only exist once vLLM builds its config (FAV2 needs
chunked prefill off; TASK_QUEUE_ENABLE=2 needs eager mode; mc2 and MLP-only TP do nothing at TP=1).
Checking here fails in the launching process, before any engine core or worker starts.
Targets: vllm>=0.23,<0.28 (create_engine_config(self, usage_context, headless)). Upstream: none.
Undo: revert().
"""

from __future__ import annotations

import functools
import logging

from rollout_ext.patches._base import Swaps, require_signature, require_vllm

NAME = "engine_config_check"
logger = logging.getLogger("vllm.rollout_ext")
_swaps = Swaps(NAME)


def engine_config(cfg, vllm_config):
    """rollout_ext's config merged with the engine's; raises ConfigError on a conflict."""
    merged = cfg.with_engine(
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        chunked_prefill=bool(vllm_config.scheduler_config.enable_chunked_prefill),
        enforce_eager=bool(vllm_config.model_config.enforce_eager),
    )
    merged.raise_on_conflicts()
    for warning in merged.warnings():
        logger.warning("rollout_ext: %s", warning)
    return merged


def apply(cfg) -> None:
    if _swaps.applied:
        return
    require_vllm(NAME)
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    require_signature(NAME, original, ["usage_context", "headless"])

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        engine_config(cfg, vllm_config)
        return vllm_config

    _swaps.replace(EngineArgs, "create_engine_config", create_engine_config)


def revert() -> None:
    _swaps.revert()
