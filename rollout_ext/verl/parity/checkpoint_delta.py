"""Lets the delta_sharded checkpoint engine accept rollout_ext the way it accepts vllm.
Why: verl/checkpoint_engine/base.py:327-331 raises NotImplementedError for delta_sharded unless
rollout.name is sglang or vllm. rollout_ext servers are vLLMHttpServer subclasses and inherit the
vLLM delta weight consumer (vllm_async_server.py:1148-1195), so the check must pass.
Only the delta_sharded case is touched; the ServerAdapter it builds is the one rollout_ext registers
anyway (verl's vLLM ServerAdapter).
Targets: verl>=0.9,<0.10 (verl.checkpoint_engine.base.CheckpointEngineWorker.__init__).
Upstream: none. Undo: revert()."""

from __future__ import annotations

import functools

from rollout_ext.patches._base import Swaps
from rollout_ext.verl.parity._guard import check_target, named_as_vllm

TARGET = "verl.checkpoint_engine.base"
_swaps = Swaps("checkpoint_delta")


def apply() -> None:
    if _swaps.applied:
        return
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    original = CheckpointEngineWorker.__init__
    check_target("checkpoint_delta", original, ("self", "rollout_config"))

    @functools.wraps(original)
    def __init__(self, rollout_config, *args, **kwargs):
        if rollout_config.checkpoint_engine.backend != "delta_sharded":
            return original(self, rollout_config, *args, **kwargs)
        with named_as_vllm(rollout_config):
            return original(self, rollout_config, *args, **kwargs)

    _swaps.replace(CheckpointEngineWorker, "__init__", __init__)


def revert() -> None:
    _swaps.revert()
