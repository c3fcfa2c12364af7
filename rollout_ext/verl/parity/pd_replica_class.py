"""Resolves rollout_ext with PD disaggregation to our subclass of verl's vLLMPDReplica.
Why: verl/workers/rollout/replica.py:394-417 picks the PD replica class by comparing the backend
name with "sglang"/"vllm" and raises NotImplementedError for any other name.
Targets: verl>=0.9,<0.10 (verl.workers.rollout.replica.get_rollout_replica_class). Upstream: none.
Undo: revert(). Note: llm_server and reward_model bind the function with `from ... import` when they
are first imported; apply() runs right after the replica module loads, before either of them."""

from __future__ import annotations

import functools

from rollout_ext.verl.names import BACKEND
from rollout_ext.verl.parity._guard import check_target

TARGET = "verl.workers.rollout.replica"
_original = None


def apply() -> None:
    global _original
    if _original is not None:
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

    module.get_rollout_replica_class = get_rollout_replica_class
    _original = original


def revert() -> None:
    global _original
    if _original is None:
        return
    import verl.workers.rollout.replica as module

    module.get_rollout_replica_class = _original
    _original = None
