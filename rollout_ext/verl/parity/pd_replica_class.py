"""Resolves rollout_ext with PD disaggregation to our subclass of verl's vLLMPDReplica.
Why: verl/workers/rollout/replica.py:394-417 picks the PD replica class by comparing the backend
name with "sglang"/"vllm" and raises NotImplementedError for any other name.
Targets: verl>=0.9,<0.10 (verl.workers.rollout.replica.get_rollout_replica_class). Upstream: none.
Undo: revert(). Note: llm_server and reward_model bind the function with `from ... import` when they
are first imported; apply() runs right after the replica module loads, before either of them."""

from __future__ import annotations

import functools

from rollout_ext.patches._base import Swaps
from rollout_ext.verl.names import BACKEND
from rollout_ext.verl.parity._guard import check_target

TARGET = "verl.workers.rollout.replica"
_swaps = Swaps("pd_replica_class")


def apply() -> None:
    if _swaps.applied:
        return
    import verl.workers.rollout.replica as module

    original = module.get_rollout_replica_class
    check_target("pd_replica_class", original, ("rollout", "disaggregation_enabled"))

    @functools.wraps(original)
    def get_rollout_replica_class(rollout, disaggregation_enabled=False):
        if rollout == BACKEND and disaggregation_enabled:
            from rollout_ext.verl.replica import RolloutExtPDReplica

            return RolloutExtPDReplica
        return original(rollout, disaggregation_enabled)

    _swaps.replace(module, "get_rollout_replica_class", get_rollout_replica_class)


def revert() -> None:
    _swaps.revert()
