"""Runs verl's validate_config with rollout.name seen as vllm, so the vLLM LoRA-rank check applies.
Why: verl/utils/config.py:212 calls get_vllm_max_lora_rank(lora_rank) only when rollout.name ==
"vllm"; without this a LoRA rank vLLM cannot serve passes validation and fails later in the engine.
Targets: verl>=0.9,<0.10 (verl.utils.config.validate_config). Upstream: none. Undo: revert().
Note: modules that ran `from verl.utils.config import validate_config` before apply() keep the
original; verl's trainers import it after `import verl`, when this is already applied."""

from __future__ import annotations

import functools

from rollout_ext.patches._base import Swaps
from rollout_ext.verl.parity._guard import check_target, named_as_vllm

TARGET = "verl.utils.config"
_swaps = Swaps("lora_rank_check")


def apply() -> None:
    if _swaps.applied:
        return
    import verl.utils.config as module

    original = module.validate_config
    check_target("lora_rank_check", original, ("config",))

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        with named_as_vllm(config.actor_rollout_ref.rollout):
            return original(config, *args, **kwargs)

    _swaps.replace(module, "validate_config", validate_config)


def revert() -> None:
    _swaps.revert()
