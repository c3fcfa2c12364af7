"""Chunked continuation on verl's client path: a sequence is generated in chunks, re-acquired at each boundary.

Hook: `ChunkedLLMServerClient`, a subclass of verl 0.9.1's `LLMServerClient`
(verl/workers/rollout/llm_server.py), the object every AgentLoopWorker calls `generate` on.
Why the client and not the server: only the client sees every chunk boundary *and* talks to the
router, so it can release, re-acquire (the policy may move the sequence), and send the next chunk
to whichever replica comes back. verl's own `FullyAsyncLLMServerClient` resumes aborted requests
the same way (prompt + tokens so far), which is what makes a move token-exact: the new replica
re-prefills prompt + generated tokens; on the same replica the prefix cache makes that ~free.

Per chunk:
- max_tokens = min(the router's chunk for this request, what is left of the request's cap). The
  router's `acquire_chunk` answers 0 where its policy will never move the sequence (verl_default,
  or a sequence that used its moves): the rest then runs in one piece, with no boundary overhead.
  min_tokens shrinks by what was generated; everything else in sampling_params is passed on unchanged;
- log-probs are concatenated; a chunk ends the sequence when it came back short, when its last
  token is EOS (unless ignore_eos) or one of `stop_token_ids`, or when the cap is reached;
- the release tells the router `generated_tokens` and `finished`, awaited so that it reaches the
  router before the next acquire;
- if the replica died (Ray actor error), the client removes it from the router, which hands its
  sequences back to the policy, and re-runs the chunk from the last boundary elsewhere.

Exactness: greedy decoding continues token for token (tested across a forced move between two real
replicas). Seeded sampling does not: every chunk restarts the request's generator. Text stop strings
are not checked across chunk boundaries; use `stop_token_ids`. Multimodal requests, and routers
without `acquire_chunk` (verl's own), are generated in one piece by verl's own code, whose release
reports no length. With our router at chunk 0, the loop runs each request as one piece, so the
router still learns its length.

Selection: pass `client_cls=ChunkedLLMServerClient` to `LLMServerManager.get_client`; for
rollout.name=rollout_ext jobs `get_client()` without a class returns it (patches/verl_chunked_client.py).
The chunk size comes from the router (`chunk_tokens` in the router YAML) unless given here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from verl.utils import normalize_token_ids
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput


logger = logging.getLogger("rollout_ext")


class ChunkedLLMServerClient(LLMServerClient):
    def __init__(self, config, load_balancer_handle=None, *, chunk_tokens: int | None = None,
                 eos_token_ids: list[int] | None = None, **kwargs) -> None:
        super().__init__(config=config, load_balancer_handle=load_balancer_handle, **kwargs)
        if chunk_tokens is not None and chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        self._chunk_tokens = chunk_tokens
        self._eos_token_ids = None if eos_token_ids is None else set(eos_token_ids)
        self.replaced_replicas: list[str] = []  # replicas this client found dead and removed
        # The router's acquire_chunk, None for a fixed-chunk router. Looked up, not tried: an error
        # raised inside the router's method must not read as "absent".
        self._acquire_chunk = getattr(self._load_balancer, "acquire_chunk", None)

    async def chunk_tokens(self) -> int:
        if self._chunk_tokens is None:
            try:
                self._chunk_tokens = int(await self._load_balancer.chunk_tokens.remote())
            except AttributeError:
                self._chunk_tokens = 0  # a router without continuation support (e.g. verl's default)
        return self._chunk_tokens

    def eos_token_ids(self) -> set[int]:
        if self._eos_token_ids is None:
            self._eos_token_ids = _model_eos_ids(self.config, getattr(self, "tokenizer", None))
        return self._eos_token_ids

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       **kwargs: Any) -> TokenOutput:
        chunk = await self.chunk_tokens()
        multimodal = any(x is not None for x in (image_data, video_data, audio_data, mm_processor_kwargs))
        # A router without `acquire_chunk` (verl's own) needs no lengths: verl's code runs it. Ours
        # learns lengths from releases, so with chunk 0 the loop below runs the request in one piece.
        if multimodal or (chunk <= 0 and self._acquire_chunk is None):
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                          image_data=image_data, video_data=video_data, audio_data=audio_data,
                                          mm_processor_kwargs=mm_processor_kwargs, **kwargs)
        kwargs.pop("mm_processor_output", None)
        if not kwargs.get("priority"):
            kwargs.pop("priority", None)  # our servers are vLLM servers: a set priority is passed on
        prompt_ids = normalize_token_ids(prompt_ids)
        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None)
        if max_tokens is None:
            rollout = self.config.actor_rollout_ref.rollout
            max_tokens = min(rollout.response_length, rollout.prompt_length + rollout.response_length - len(prompt_ids))
        min_tokens = int(params.pop("min_tokens", 0) or 0)
        stops = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos", False):
            stops |= self.eos_token_ids()

        tokens: list[int] = []
        log_probs: list[float] = []
        output = None
        chunks, replicas, preempted, cached, acquire_s = 0, [], 0, None, 0.0
        while True:
            context = prompt_ids + tokens
            # The router gets the cap, not the rest of the sampling params.
            acquired_s = time.perf_counter()
            server_id, server, next_chunk = await self._acquire(request_id, context, max_tokens, chunk)
            if chunks:
                acquire_s += time.perf_counter() - acquired_s  # a boundary's round trip (the first may wait for a slot)
            # 0: the policy will not move it again. Otherwise our chunk, or more if the router asks.
            budget = min(max(chunk, next_chunk) if next_chunk else max_tokens, max_tokens - len(tokens))
            chunk_params = {**params, "max_tokens": budget}
            if min_tokens > len(tokens):
                chunk_params["min_tokens"] = min(budget, min_tokens - len(tokens))
            try:
                output = await server.generate.remote(request_id=self._vllm_request_id(request_id),
                                                      prompt_ids=context, sampling_params=chunk_params, **kwargs)
            except ray.exceptions.RayActorError:
                # The replica died: the router re-dispatches its sequences; this chunk reruns elsewhere.
                logger.warning("rollout_ext: replica %s died; re-running request %s from token %d",
                               server_id, request_id, len(tokens))
                self.replaced_replicas.append(server_id)
                await self._load_balancer.remove_servers.remote([server_id])
                continue
            except BaseException:
                await self._release(server_id, request_id, len(tokens), finished=True)
                raise
            chunks += 1
            replicas.append(server_id)
            preempted += output.num_preempted or 0
            if cached is None:
                cached = output.extra_fields.get("num_cached_tokens")
            tokens += output.token_ids
            if output.log_probs is not None:
                log_probs += output.log_probs
            finished = (
                output.stop_reason == "aborted"
                or len(output.token_ids) < budget
                or (bool(output.token_ids) and output.token_ids[-1] in stops and len(tokens) >= min_tokens)
                or len(tokens) >= max_tokens
            )
            await self._release(server_id, request_id, len(tokens), finished)
            if finished:
                break

        global_steps = output.extra_fields.get("global_steps")
        extra = {**output.extra_fields, "num_cached_tokens": cached, "min_global_steps": global_steps,
                 "max_global_steps": global_steps, "continuation_chunks": chunks, "continuation_replicas": replicas,
                 "continuation_boundary_acquire_s": acquire_s}
        return TokenOutput(token_ids=tokens, log_probs=log_probs if output.log_probs is not None else None,
                           routed_experts=output.routed_experts, stop_reason=output.stop_reason,
                           num_preempted=preempted, extra_fields=extra)

    async def _acquire(self, request_id: str, context: list[int], max_tokens: int, chunk: int):
        """(server id, handle, the router's chunk for this sequence; 0: the rest in one piece)."""
        fields = {"prompt_ids": context, "sampling_params": {"max_tokens": max_tokens}}
        if self._acquire_chunk is not None:
            return await self._acquire_chunk.remote(request_id=request_id, **fields)
        server_id, server = await self._acquire_server(request_id, **fields)  # a fixed-chunk router
        return server_id, server, chunk

    async def _release(self, server_id: str, request_id: str, generated_tokens: int, finished: bool) -> None:
        await self._load_balancer.release_server.remote(server_id=server_id, request_id=request_id,
                                                        generated_tokens=generated_tokens, finished=finished)


def _model_eos_ids(config, tokenizer) -> set[int]:
    """EOS ids vLLM stops on: the model's generation_config (local files only), else the tokenizer's."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(config.actor_rollout_ref.model.path, local_files_only=True)
        eos = gen.eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except (OSError, ValueError, AttributeError):
        pass
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
