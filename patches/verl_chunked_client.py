"""Gives rollout.name=rollout_ext jobs our client wherever verl asks for one of its own two.
Replaces: `verl.workers.rollout.llm_server.LLMServerManager.get_client` with a wrapper that passes
`client_cls=ChunkedLLMServerClient` (rollout_ext/verl/continuation.py) when the job's rollout.name
is rollout_ext and the caller named no class (the sync trainers, one-step-off, AgentLoopManager) or
verl's `FullyAsyncLLMServerClient` (colocate_async, separate_async, fully async:
trainer_colocate_async.py:26-28, trainer_separate_async.py:213-215, fully_async_rollouter.py:292-302
and 847-853).
Why: verl's plain client generates a request in one piece and its abort-resuming client releases an
aborted chunk as finished, so the router would never move a straggler and would read every resume
as a new request. Our client is a FullyAsyncLLMServerClient (it takes `only_hybrid` and resumes
aborted chunks as verl's does) that stops at chunk boundaries and tells the router what happened.
Other explicit classes, and other backends, are left alone.
Targets: verl>=0.9,<0.10 (get_client(self, client_cls=None, **kwargs)). Upstream: none.
Undo: revert(). Remove when verl takes the client class from the rollout config.
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import backend_name, signature
from rollout_ext.verl.names import BACKEND


def _make(original):
    def get_client(self, client_cls=None, **kwargs):
        if backend_name(self.rollout_config) == BACKEND:
            from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

            from rollout_ext.verl.continuation import ChunkedLLMServerClient

            if client_cls in (None, FullyAsyncLLMServerClient):
                client_cls = ChunkedLLMServerClient
        return original(self, client_cls=client_cls, **kwargs)

    return get_client


_patch = Wrap("verl_chunked_client", "verl.workers.rollout.llm_server", "LLMServerManager.get_client", _make,
              signature("self", "client_cls"))
apply, revert = _patch.apply, _patch.revert
