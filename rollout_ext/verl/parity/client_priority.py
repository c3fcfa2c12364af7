"""Gives each LLMServerClient a config view in which rollout.name reads "vllm".
Why: verl/workers/rollout/llm_server.py:146-149 forwards a request's `priority` to the server only
when rollout.name == "vllm" and silently drops it otherwise; our servers are vLLM servers and honour
it (scheduling_policy=priority). The client reads the name nowhere else except :143 (sglang video
payload), which stays off either way. The view is a deep copy, so the trainer's config is untouched.
Targets: verl>=0.9,<0.10 (verl.workers.rollout.llm_server.LLMServerClient.__init__). Upstream: none.
Undo: revert()."""

from __future__ import annotations

import copy
import functools

from rollout_ext.patches._base import Swaps
from rollout_ext.verl.names import BACKEND, VLLM_BACKEND
from rollout_ext.verl.parity._guard import check_target, set_name

TARGET = "verl.workers.rollout.llm_server"
_swaps = Swaps("client_priority")


def apply() -> None:
    if _swaps.applied:
        return
    from verl.workers.rollout.llm_server import LLMServerClient

    original = LLMServerClient.__init__
    check_target("client_priority", original, ("self", "config"))

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        rollout = _rollout_of(self.config)
        if rollout is not None and rollout.get("name") == BACKEND:
            view = copy.deepcopy(self.config)
            set_name(_rollout_of(view), VLLM_BACKEND)
            self.config = view

    _swaps.replace(LLMServerClient, "__init__", __init__)


def revert() -> None:
    _swaps.revert()


def _rollout_of(config):
    try:
        return config.actor_rollout_ref.rollout
    except AttributeError:
        return None
