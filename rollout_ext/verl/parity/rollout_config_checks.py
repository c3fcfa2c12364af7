"""Runs verl's RolloutConfig.__post_init__ checks for rollout_ext as if the backend were vllm.
Why: verl/workers/config/rollout.py:319-323 rejects pipeline_model_parallel_size > 1 for vllm (the
vLLM server path has no PP), and :341-344 allows PD disaggregation only for sglang/vllm. rollout_ext
is the vLLM server path, so it must fail and pass exactly where vllm does.
Targets: verl>=0.9,<0.10 (verl.workers.config.rollout.RolloutConfig.__post_init__). Upstream: none
(verl has no backend alias). Undo: revert()."""

from __future__ import annotations

import functools

from rollout_ext.patches._base import Swaps
from rollout_ext.verl.parity._guard import check_target, named_as_vllm

TARGET = "verl.workers.config.rollout"
_swaps = Swaps("rollout_config_checks")


def apply() -> None:
    if _swaps.applied:
        return
    from verl.workers.config.rollout import RolloutConfig

    original = RolloutConfig.__post_init__
    check_target("rollout_config_checks", original, ("self",))

    @functools.wraps(original)
    def __post_init__(self):
        with named_as_vllm(self):
            original(self)

    _swaps.replace(RolloutConfig, "__post_init__", __post_init__)


def revert() -> None:
    _swaps.revert()
