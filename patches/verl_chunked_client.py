"""Gives rollout.name=rollout_ext jobs the chunked client when verl asks for its default client.
Replaces: `verl.workers.rollout.llm_server.LLMServerManager.get_client` with a wrapper that passes
`client_cls=ChunkedLLMServerClient` (rollout_ext/verl/continuation.py) when the caller named no
class and the job's rollout.name is rollout_ext.
Why: verl's trainers and AgentLoopManager call `get_client()` without a class and get
`LLMServerClient`, which generates a request in one piece; only a client that stops at chunk
boundaries lets the router move a straggler. Explicit classes (e.g. FullyAsyncLLMServerClient) are
left alone, and so are other backends.
Targets: verl>=0.9,<0.10 (get_client(self, client_cls=None, **kwargs)). Upstream: none.
Undo: revert(). Remove when verl takes the client class from the rollout config.
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import backend_name, signature
from rollout_ext.verl.names import BACKEND


def _make(original):
    def get_client(self, client_cls=None, **kwargs):
        if client_cls is None and backend_name(self.rollout_config) == BACKEND:
            from rollout_ext.verl.continuation import ChunkedLLMServerClient

            client_cls = ChunkedLLMServerClient
        return original(self, client_cls=client_cls, **kwargs)

    return get_client


_patch = Wrap("verl_chunked_client", "verl.workers.rollout.llm_server", "LLMServerManager.get_client", _make,
              signature("self", "client_cls"))
apply, revert = _patch.apply, _patch.revert
