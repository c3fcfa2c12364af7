"""Runs verl's RolloutConfig.__post_init__ checks for rollout_ext as if the backend were vllm.
Why: verl/workers/config/rollout.py:319-323 rejects pipeline_model_parallel_size > 1 for vllm (the
vLLM server path has no PP), and :341-344 allows PD disaggregation only for sglang/vllm. rollout_ext
is the vLLM server path, so it must fail and pass exactly where vllm does.
Targets: verl>=0.9,<0.10 (verl.workers.config.rollout.RolloutConfig.__post_init__). Upstream: none
(verl has no backend alias). Undo: revert().
Remove when verl treats rollout_ext as a vLLM backend (an alias in its rollout registry).
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import named_as_vllm, signature


def _make(original):
    def __post_init__(self):
        with named_as_vllm(self):
            original(self)

    return __post_init__


_patch = Wrap("verl_rollout_config_checks", "verl.workers.config.rollout", "RolloutConfig.__post_init__", _make,
              signature("self"))
apply, revert = _patch.apply, _patch.revert
