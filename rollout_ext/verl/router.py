"""verl 0.9.1 `RequestLoadBalancer` over a rollout_ext balancing policy (a Ray actor).

Select it with `actor_rollout_ref.rollout.router_config_path=examples/router_tail_aware.yaml`;
verl loads the YAML, imports `router_class` and starts `ray.remote(TailAwareRouter)` with
`(servers, yaml_dict)` (verl/workers/rollout/router.py:`_create_plugin_extension`).

The policy (rollout_ext.balance) is plain Python; this actor only translates verl's calls:
- `acquire_server(request_id, prompt_ids=..., sampling_params=...)`: the first acquire of a
  request id submits it (group = hash of its prompt tokens, so the samples of one prompt share a
  group); later acquires are chunk boundaries, with `len(prompt_ids) - prompt_len` tokens already
  generated. When the policy parks a request (answer None), the call awaits until the policy
  places it: the method is async, so the actor is an asyncio actor and a parked caller does not
  block other calls (verl's client awaits `acquire_server.remote(...)`, llm_server.py:81).
- `release_server(server_id, request_id, generated_tokens=None, finished=None)`: verl's plain
  client passes only the ids, and one generate call is one whole turn, so a missing `finished`
  means finished. Its length is then unknown, and the policy learns nothing from it (before
  session 17 it recorded a length of 0, which left the length predictor NaN after its refit).
  `ChunkedLLMServerClient` (continuation.py) passes both fields after each chunk, and after the
  one piece it runs where the router's chunk is 0.
- A request id acquired again after it finished is a new turn of a multi-turn conversation; it
  becomes a new policy request (`<id>#<turn>`), since the policy never re-opens a finished one.
- `remove_servers` hands the removed replicas' in-flight requests back to the policy; their
  clients re-acquire them (continuation.py does so when a replica dies mid-chunk).

Calls from one client may arrive out of order in an asyncio actor, so an acquire of a request
still held on a replica first releases it there (finished=False) instead of trusting order.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from rollout_ext.balance.predictor import LengthPredictor, PredictorConfig
from rollout_ext.balance.request import Request
from rollout_ext.balance.registry import POLICIES, ROUTER_POLICIES
from rollout_ext.balance.registry import make_policy as registry_policy
from rollout_ext.balance.step_model import StepModel
from rollout_ext.balance.tail_aware import TailAwareConfig

POLICY_NAMES = ROUTER_POLICIES
NO_SERVERS = "No available servers in load balancer"  # verl's wording: FullyAsync clients retry on it


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterConfig:
    policy: str = "tail_aware"  # one of POLICY_NAMES
    chunk_tokens: int = 1024  # continuation chunk for ChunkedLLMServerClient (0: no chunking)
    slots_per_replica: int = 256  # running sequences a replica takes (match rollout.max_num_seqs)
    default_max_tokens: int = 4096  # response cap when a request's sampling_params carry none
    seed: int = 0  # tie-breaks inside the policy
    step_model: dict = field(default_factory=dict)  # StepModel fields (tail_aware only)
    tail_aware: dict = field(default_factory=dict)  # TailAwareConfig fields (tail_aware only)
    predictor: dict = field(default_factory=dict)  # PredictorConfig fields (tail_aware only)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"router policy={self.policy!r}; allowed: {', '.join(POLICY_NAMES)}")
        if self.chunk_tokens < 0 or self.slots_per_replica < 1 or self.default_max_tokens < 1:
            raise ValueError("router: chunk_tokens >= 0, slots_per_replica >= 1, default_max_tokens >= 1 required")
        for key, struct in (("step_model", StepModel), ("tail_aware", TailAwareConfig), ("predictor", PredictorConfig)):
            unknown = sorted(set(getattr(self, key)) - set(struct.__dataclass_fields__))
            if unknown:
                raise ValueError(f"router config {key}: unknown fields {unknown}; "
                                 f"allowed: {sorted(struct.__dataclass_fields__)}")

    @classmethod
    def from_yaml_dict(cls, raw: dict | None) -> "RouterConfig":
        raw = dict(raw or {})
        raw.pop("router_class", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"router config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**raw)


def make_policy(config: RouterConfig):
    """The balancing policy named in the router config (no true lengths: oracle policies are sim-only)."""
    predictor = LengthPredictor(PredictorConfig(**config.predictor)) if POLICIES[config.policy].predicted else None
    return registry_policy(config.policy, predictor=predictor,
                           model=StepModel(**{"max_num_seqs": config.slots_per_replica, **config.step_model}),
                           tail_aware=config.tail_aware, slots_per_replica=config.slots_per_replica, seed=config.seed)


def prompt_hash(prompt_ids) -> str:
    data = ",".join(str(int(t)) for t in prompt_ids).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(slots=True)
class _Turn:
    """One turn of one verl request, as the router tracks it (the policy knows it by `key`)."""

    key: str  # policy request id: the verl request id, or "<id>#<turn>" from its second turn on
    prompt_len: int  # prompt tokens of this turn
    generated: int = 0  # tokens generated as of the last chunk boundary (while a chunk runs: at its start)
    server: str | None = None  # replica running its chunk now
    finished: bool = False
    waiter: asyncio.Future | None = None  # set while its acquire is parked


class TailAwareRouter:
    """Implements every method of verl's RequestLoadBalancer protocol; see the module docstring."""

    def __init__(self, servers: dict[str, Any], config: dict | None = None) -> None:
        self.config = RouterConfig.from_yaml_dict(config)
        self.policy = make_policy(self.config)
        self._handles: dict[str, Any] = {}
        self._inflight: dict[str, int] = {}  # server -> chunks running there (verl's status view)
        self._current: dict[str, _Turn] = {}  # verl request id -> its latest turn
        self._turn_count: dict[str, int] = {}  # verl request id -> turns started
        self._live: dict[str, _Turn] = {}  # policy request id -> its unfinished turn
        self._group_sizes: dict[str, int] = {}
        self._acquires = 0
        self._finished = 0  # turns finished
        self._epochs = 0
        # Chunks that ended on each replica with the sequence still unfinished (it may move next).
        self._open_releases: dict[str, int] = {}
        self._cpu0_s = time.process_time()  # the router's own CPU, which competes with the engines' on a small host
        self.add_servers(servers)

    # ---- verl protocol ----------------------------------------------------------------------
    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids", "sampling_params"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(self, request_id: str, prompt_ids=None, sampling_params=None, **_unused):
        turn = await self._place_turn(request_id, prompt_ids, sampling_params)
        return turn.server, self._handles[turn.server]

    async def _place_turn(self, request_id: str, prompt_ids, sampling_params) -> _Turn:
        """Submit or continue the turn, wait until the policy places it, and mark it running there."""
        turn = self._turn_for(request_id, prompt_ids, sampling_params)
        generated = max(0, len(prompt_ids) - turn.prompt_len) if prompt_ids is not None else turn.generated
        if turn.server is not None:
            # A release from the same client may still be queued behind this call.
            self._release(turn, turn.server, generated, finished=False)
        while True:
            if not self._handles:
                raise RuntimeError(NO_SERVERS)
            server_id = self.policy.acquire(turn.key, generated, time.monotonic())
            if server_id is None:
                # Register before pumping the policy: the pump may place this very request.
                waiter = turn.waiter = asyncio.get_running_loop().create_future()
                self._wake_placed()
                server_id = await waiter
            else:
                self._wake_placed()
            if server_id in self._handles:
                break
            # Placed on a replica that was removed before this call woke up: ask again.
        turn.server, turn.generated = server_id, generated
        self._acquires += 1
        self._inflight[server_id] += 1
        return turn

    def release_server(self, server_id: str, request_id: str | None = None,
                       generated_tokens: int | None = None, finished: bool | None = None) -> None:
        turn = self._current.get(request_id) if request_id is not None else None
        if turn is None or turn.server != server_id:
            return  # stale (replica removed, or already released by a later acquire)
        if not finished and generated_tokens is not None and generated_tokens <= turn.generated:
            return  # the previous chunk's release, overtaken by this chunk's acquire (no chunk ends empty)
        if finished is None:
            finished = True  # verl's plain client: one generate call is the whole turn
        if generated_tokens is None and not finished:
            generated_tokens = turn.generated  # a boundary without a count: the chunk's start
        # None (finished): verl's plain client reports no length; the policy learns nothing from the turn.
        self._release(turn, server_id, generated_tokens, finished)

    def add_servers(self, servers: dict[str, Any]) -> None:
        for server_id, handle in servers.items():
            self._handles[server_id] = handle
            self._inflight.setdefault(server_id, 0)
            self.policy.add_replica(server_id)
        self._wake_placed()

    def remove_servers(self, server_ids: list[str]) -> list[str]:
        """Returns the policy request ids that were running there; their clients re-acquire them."""
        orphans: list[str] = []
        for server_id in server_ids:
            if server_id not in self._handles:
                continue
            orphans += self.policy.remove_replica(server_id)
            del self._handles[server_id]
            self._inflight.pop(server_id, None)
        for key in orphans:
            self._live[key].server = None  # their releases from the dead replica are stale now
        self._wake_placed()
        return orphans

    def get_all_servers(self) -> list[str]:
        return list(self._handles)

    def get_status(self) -> dict:
        return {
            "servers": dict(self._inflight),
            "total_inflight": sum(self._inflight.values()),
            "active_servers": len(self._handles),
            "registered_handles": list(self._handles),
            "waiting": sum(1 for t in self._live.values() if t.waiter is not None and not t.waiter.done()),
            "acquires": self._acquires,
            "open_releases": dict(self._open_releases),
            "router_cpu_s": round(time.process_time() - self._cpu0_s, 4),
            "policy": self.policy.snapshot(),
        }

    def clear_sticky_cache(self) -> dict:
        """Forgets finished turns. In-flight sequences keep their replica: moving them is the policy's call."""
        finished = [rid for rid, turn in self._current.items() if turn.finished]
        for rid in finished:
            del self._current[rid]
        return {"cleared_entries": len(finished), "server_loads": dict(self._inflight)}

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    # ---- rollout_ext extras -----------------------------------------------------------------
    def chunk_tokens(self) -> int:
        """Continuation chunk size that ChunkedLLMServerClient asks for (0: generate in one piece)."""
        return self.config.chunk_tokens

    async def acquire_chunk(self, request_id: str, prompt_ids=None, sampling_params=None):
        """`acquire_server`, plus the tokens to run before the next boundary: `chunk_tokens` where the
        policy may move the sequence there, 0 (the rest in one piece) where it never will."""
        turn = await self._place_turn(request_id, prompt_ids, sampling_params)
        return turn.server, self._handles[turn.server], self.policy.next_chunk_tokens(turn.key, self.config.chunk_tokens)

    def end_epoch(self) -> dict:
        """Call after each training step's rollout (patches/verl_epoch_end.py does, in verl jobs):
        the length predictor turns this batch into history. Returns the epochs closed so far and
        the policy's moves."""
        predictor = getattr(self.policy, "predictor", None)
        if predictor is not None:
            predictor.end_epoch()
        self._group_sizes.clear()  # sample indices restart with the next batch
        self._epochs += 1
        return {"epochs": self._epochs, "moves": self.policy.moves, "finished": self._finished,
                "acquires": self._acquires}

    def policy_key(self, request_id: str) -> str | None:
        turn = self._current.get(request_id)
        return turn.key if turn is not None else None

    # ---- internals --------------------------------------------------------------------------
    def _turn_for(self, request_id: str, prompt_ids, sampling_params) -> _Turn:
        turn = self._current.get(request_id)
        if turn is not None and not turn.finished:
            return turn
        count = self._turn_count.get(request_id, 0)
        self._turn_count[request_id] = count + 1
        key = request_id if count == 0 else f"{request_id}#{count}"
        ids = list(prompt_ids) if prompt_ids is not None else []
        group = prompt_hash(ids)
        sample = self._group_sizes.get(group, 0)
        self._group_sizes[group] = sample + 1
        max_tokens = (sampling_params or {}).get("max_tokens") or (sampling_params or {}).get("max_new_tokens")
        turn = _Turn(key, len(ids))
        self._current[request_id] = self._live[key] = turn
        self.policy.submit(Request(key, group, sample, len(ids), int(max_tokens or self.config.default_max_tokens),
                                   group))
        return turn

    def _release(self, turn: _Turn, server_id: str, generated: int | None, finished: bool) -> None:
        turn.server, turn.finished = None, finished
        if generated is not None:
            turn.generated = generated
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1
        self.policy.release(turn.key, server_id, generated, finished, time.monotonic())
        if finished:
            del self._live[turn.key]
            self._finished += 1
        else:
            self._open_releases[server_id] = self._open_releases.get(server_id, 0) + 1
        self._wake_placed()

    def _wake_placed(self) -> None:
        for key, server_id in self.policy.take_ready():
            turn = self._live.get(key)
            if turn is None or turn.waiter is None:
                continue
            waiter, turn.waiter = turn.waiter, None
            if not waiter.done():
                waiter.set_result(server_id)
