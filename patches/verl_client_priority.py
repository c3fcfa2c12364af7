"""Gives each LLMServerClient a config view in which rollout.name reads "vllm".
Why: verl/workers/rollout/llm_server.py:146-149 forwards a request's `priority` to the server only
when rollout.name == "vllm" and silently drops it otherwise; our servers are vLLM servers and honour
it (scheduling_policy=priority). The client reads the name nowhere else except :143 (sglang video
payload), which stays off either way. The view is a deep copy, so the trainer's config is untouched.
Targets: verl>=0.9,<0.10 (verl.workers.rollout.llm_server.LLMServerClient.__init__). Upstream: none.
Undo: revert().
Remove when verl treats rollout_ext as a vLLM backend (an alias in its rollout registry).
"""

from __future__ import annotations

import copy

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import rollout_ext_job, set_name, signature
from rollout_ext.verl.names import VLLM_BACKEND


def _make(original):
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        if rollout_ext_job(self.config):
            view = copy.deepcopy(self.config)
            set_name(view.actor_rollout_ref.rollout, VLLM_BACKEND)
            self.config = view

    return __init__


_patch = Wrap("verl_client_priority", "verl.workers.rollout.llm_server", "LLMServerClient.__init__", _make,
              signature("self", "config"))
apply, revert = _patch.apply, _patch.revert
