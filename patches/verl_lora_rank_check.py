"""Runs verl's validate_config with rollout.name seen as vllm, so the vLLM LoRA-rank check applies.
Why: verl/utils/config.py:212 calls get_vllm_max_lora_rank(lora_rank) only when rollout.name ==
"vllm"; without this a LoRA rank vLLM cannot serve passes validation and fails later in the engine.
Targets: verl>=0.9,<0.10 (verl.utils.config.validate_config). Upstream: none. Undo: revert().
Note: modules that ran `from verl.utils.config import validate_config` before apply() keep the
original; verl's trainers import it after `import verl`, when this is already applied.
Remove when verl treats rollout_ext as a vLLM backend (an alias in its rollout registry).
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import named_as_vllm, signature


def _make(original):
    def validate_config(config, *args, **kwargs):
        with named_as_vllm(config.actor_rollout_ref.rollout):
            return original(config, *args, **kwargs)

    return validate_config


_patch = Wrap("verl_lora_rank_check", "verl.utils.config", "validate_config", _make, signature("config"))
apply, revert = _patch.apply, _patch.revert
