"""Resolves rollout_ext with PD disaggregation to our subclass of verl's vLLMPDReplica.
Why: verl/workers/rollout/replica.py:394-417 picks the PD replica class by comparing the backend
name with "sglang"/"vllm" and raises NotImplementedError for any other name.
Targets: verl>=0.9,<0.10 (verl.workers.rollout.replica.get_rollout_replica_class). Upstream: none.
Undo: revert(). Note: llm_server and reward_model bind the function with `from ... import` when they
are first imported; apply() runs right after the replica module loads, before either of them.
Remove when verl treats rollout_ext as a vLLM backend (an alias in its rollout registry).
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import signature
from rollout_ext.verl.names import BACKEND


def _make(original):
    def get_rollout_replica_class(rollout, disaggregation_enabled=False):
        if rollout == BACKEND and disaggregation_enabled:
            from rollout_ext.verl.replica import RolloutExtPDReplica

            return RolloutExtPDReplica
        return original(rollout, disaggregation_enabled)

    return get_rollout_replica_class


_patch = Wrap("verl_pd_replica_class", "verl.workers.rollout.replica", "get_rollout_replica_class", _make,
              signature("rollout", "disaggregation_enabled"))
apply, revert = _patch.apply, _patch.revert
