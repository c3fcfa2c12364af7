"""Lets the delta_sharded checkpoint engine accept rollout_ext the way it accepts vllm.
Why: verl/checkpoint_engine/base.py:327-331 raises NotImplementedError for delta_sharded unless
rollout.name is sglang or vllm. rollout_ext servers are vLLMHttpServer subclasses and inherit the
vLLM delta weight consumer (vllm_async_server.py:1148-1195), so the check must pass.
Only the delta_sharded case is touched; the ServerAdapter it builds is the one rollout_ext registers
anyway (verl's vLLM ServerAdapter).
Targets: verl>=0.9,<0.10 (verl.checkpoint_engine.base.CheckpointEngineWorker.__init__).
Upstream: none. Undo: revert().
Remove when verl treats rollout_ext as a vLLM backend (an alias in its rollout registry).
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import named_as_vllm, signature


def _make(original):
    def __init__(self, rollout_config, *args, **kwargs):
        if rollout_config.checkpoint_engine.backend != "delta_sharded":
            return original(self, rollout_config, *args, **kwargs)
        with named_as_vllm(rollout_config):
            return original(self, rollout_config, *args, **kwargs)

    return __init__


_patch = Wrap("verl_checkpoint_delta", "verl.checkpoint_engine.base", "CheckpointEngineWorker.__init__", _make,
              signature("self", "rollout_config"))
apply, revert = _patch.apply, _patch.revert
