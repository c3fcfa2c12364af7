"""verl 0.9.1 `RequestLoadBalancer` over a rollout_ext balancing policy (a Ray actor).

Select it with `actor_rollout_ref.rollout.router_config_path=examples/router_tail_aware.yaml`;
verl loads the YAML, imports `router_class` and starts it with `(servers, yaml_dict)`
(verl/workers/rollout/router.py:`_create_plugin_extension`). Name `TailAwareRouterActor` there, not
the plain class `TailAwareRouter` (see "Waiting requests" below; the config refuses the plain one).

The policy (rollout_ext.balance) is plain Python; this actor only translates verl's calls:
- `acquire_server(request_id, prompt_ids=..., sampling_params=...)`: the first acquire of a
  request id submits it (group = hash of its prompt tokens, so the samples of one prompt share a
  group); later acquires are chunk boundaries, with `len(prompt_ids) - prompt_len` tokens already
  generated. When the policy parks a request (answer None), the call awaits until the policy
  places it (verl's client awaits `acquire_server.remote(...)`, llm_server.py:81).
- `release_server(server_id, request_id, generated_tokens=None, finished=None)`: verl's plain
  client passes only the ids, and one generate call is one whole turn, so a missing `finished`
  means finished. Its length is then unknown, and the policy learns nothing from it.
  `ChunkedLLMServerClient` (continuation.py) passes both fields after each chunk, and after the
  one piece it runs where the router's chunk is 0.
- A request id acquired again after it finished is a new turn of a multi-turn conversation: a new
  policy request under the same id, in its first turn's group, sent back to the replica its last
  turn ran on (that replica's prefix cache holds the conversation), as verl's own router keeps a
  conversation on one replica; like any sequence, it may move at a later chunk boundary.
- `remove_servers` hands the removed replicas' in-flight requests back to the policy; their
  clients re-acquire them (continuation.py does so when a replica dies mid-chunk).
- `release_server(..., aborted=True)`: the chunk was aborted because verl paused the replicas (a
  weight sync, `rebalance_requests`, the end of a colocated sample). The sequence stays live under
  its record, and the router places nothing, neither its resume nor any waiting request, until
  every replica's submission gate is open again (polled every GATE_POLL_S through the server's
  `submission_open`). So after verl's `abort_all_requests`, `get_total_inflight` drains to 0 and
  stays there until `resume_generation`, which is what `rebalance_requests` waits for; a router
  that kept placing would send waiting requests to the closed gates, where they hold the count up.
  Servers without `submission_open` (verl's own) count as open.

Waiting requests. Every parked acquire holds one of the actor's concurrent calls while it awaits.
Ray gives an async actor started as `ray.remote(cls)` 1,000 of them, so with more than 1,000
requests waiting for a slot, a release (the call that frees one) queues behind them and never runs.
verl starts a class that is already a `ray.actor.ActorClass` as it is, so `TailAwareRouterActor`
carries its own options: MAX_CONCURRENT_CALLS, beyond any number of requests a rollout can hold
live. Concurrency groups were the other way to keep releases apart from acquires, but each group of
an async actor runs on its own thread and event loop, which would put a lock around every policy
call; one loop with room for every waiting call needs none. Waiting outside the actor would need a
client that retries, and verl's plain client does not.

State. One record per verl request id (`_Conversation`), dropped once its turn finished and
`clear_sticky_cache` runs (verl's trainers call it between steps), or beyond STICKY_CONVERSATIONS
finished ones, oldest first; the policy holds only live requests. A long job's router holds what is
live, so its memory stays flat.

Calls from one client may arrive out of order in an asyncio actor, so an acquire of a request
still held on a replica first releases it there (finished=False) instead of trusting order.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_ext.balance.predictor import PredictorConfig
from rollout_ext.balance.request import Request
from rollout_ext.balance.registry import ROUTER_POLICIES, make_policy
from rollout_ext.balance.step_model import StepModel
from rollout_ext.balance.tail_aware import TailAwareConfig

POLICY_NAMES = ROUTER_POLICIES
NO_SERVERS = "No available servers in load balancer"  # verl's wording: FullyAsync clients retry on it
GATE_POLL_S = 0.1  # while paused by an abort: how often the replicas' submission gates are read
# Finished conversations kept for their next turn when nobody calls clear_sticky_cache (verl's own
# router keeps as many: DEFAULT_ROUTING_CACHE_SIZE).
STICKY_CONVERSATIONS = 10_000
# Groups whose sample counter a batch keeps when nobody calls end_epoch (the predictor's own cap).
MAX_GROUPS = PredictorConfig().max_groups


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
        router_class = raw.pop("router_class", None)
        if router_class == f"{__name__}.TailAwareRouter":
            raise ValueError(f"router_class={router_class!r} starts with Ray's default of 1,000 concurrent calls, "
                             f"and more waiting requests stall every release; allowed: {__name__}.TailAwareRouterActor")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"router config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def make_policy(self):
        """The balancing policy it names (no true lengths: the reference policies are sim-only)."""
        return make_policy(self.policy, model=StepModel(**{"max_num_seqs": self.slots_per_replica, **self.step_model}),
                           slots_per_replica=self.slots_per_replica, seed=self.seed, tail_aware=self.tail_aware,
                           predictor_config=PredictorConfig(**self.predictor))


def prompt_hash(prompt_ids) -> str:
    # Token ids as 8-byte ints: the same prompt hashes the same in every process, at a few µs for 4K tokens.
    return hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=8).hexdigest()


@dataclass(slots=True, eq=False)
class _Conversation:
    """One verl request id. Its turns run one after another, each a policy request under the same id."""

    request_id: str
    group: str  # its first turn's group (the hash of that prompt): later turns keep it
    sample: int  # its index in that group
    turns: int = 0  # turns started
    prompt_len: int = 0  # prompt tokens of the current turn
    generated: int = 0  # tokens of the current turn as of its last boundary (while a chunk runs: at its start)
    server: str | None = None  # replica running its chunk now
    home: str | None = None  # replica its latest chunk ran on (holds the conversation's prefix)
    finished: bool = True  # the current turn finished (True before the first)
    waiter: asyncio.Future | None = None  # set while its acquire is parked


class TailAwareRouter:
    """Implements every method of verl's RequestLoadBalancer protocol; see the module docstring.
    verl starts `TailAwareRouterActor`; tests and benches may drive this class in one process."""

    def __init__(self, servers: dict[str, Any], config: dict | None = None) -> None:
        self.config = RouterConfig.from_yaml_dict(config)
        self.policy = self.config.make_policy()
        self._handles: dict[str, Any] = {}
        self._inflight: dict[str, int] = {}  # server -> chunks running there (verl's status view)
        # Each conversation is in one of the two, by state (as a scheduler keeps waiting and running queues):
        self._live: dict[str, _Conversation] = {}  # its turn has not finished
        self._sticky: OrderedDict[str, _Conversation] = OrderedDict()  # finished, oldest first
        self._group_sizes: OrderedDict[str, int] = OrderedDict()  # group -> samples seen this batch
        self._parked = 0  # acquires awaiting a placement
        self._acquires = 0
        self._finished = 0  # turns finished
        self._lengths = 0  # turns finished with their length reported (what the predictor learns from)
        self._later_turns = 0  # turns after a conversation's first (multi-turn, or a resume read as a new request)
        self._aborts = 0  # chunks aborted by a replica pause; each resumes under its record
        self._epochs = 0
        # Chunks that ended on each replica with the sequence still unfinished (it may move next).
        self._open_releases: dict[str, int] = {}
        self._cpu0_s = time.process_time()  # the router's own CPU, which competes with the engines' on a small host
        # Cleared by an aborted release (verl paused the replicas), set once every replica's gate is open.
        self._open = asyncio.Event()
        self._open.set()
        self._held = 0  # acquires waiting for the replicas to reopen
        self._pauses = 0
        self._reopener: asyncio.Task | None = None
        self.add_servers(servers)

    # ---- verl protocol ----------------------------------------------------------------------
    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids", "sampling_params"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(self, request_id: str, prompt_ids=None, sampling_params=None, **_unused):
        conv = await self._place_turn(request_id, prompt_ids, sampling_params)
        return conv.server, self._handles[conv.server]

    async def _place_turn(self, request_id: str, prompt_ids, sampling_params) -> _Conversation:
        """Submit or continue the turn, wait until the policy places it, and mark it running there."""
        conv = self._turn_for(request_id, prompt_ids, sampling_params)
        generated = max(0, len(prompt_ids) - conv.prompt_len) if prompt_ids is not None else conv.generated
        if conv.server is not None:
            # A release from the same client may still be queued behind this call.
            self._release(conv, conv.server, generated, finished=False)
        while not self._open.is_set():
            self._held += 1
            try:
                await self._open.wait()
            finally:
                self._held -= 1
        while True:
            if not self._handles:
                raise RuntimeError(NO_SERVERS)
            server_id = self.policy.acquire(request_id, generated, time.monotonic())
            if server_id is None:
                # Register before pumping the policy: the pump may place this very request.
                waiter = conv.waiter = asyncio.get_running_loop().create_future()
                self._parked += 1
                try:
                    self._wake_placed()
                    server_id = await waiter
                finally:
                    self._parked -= 1
            else:
                self._wake_placed()
            if server_id in self._handles:
                break
            # Placed on a replica that was removed before this call woke up: ask again.
        conv.server = conv.home = server_id
        conv.generated = generated
        self._acquires += 1
        self._inflight[server_id] += 1
        return conv

    def release_server(self, server_id: str, request_id: str | None = None,
                       generated_tokens: int | None = None, finished: bool | None = None,
                       aborted: bool = False) -> None:
        if aborted:
            self._aborts += 1
            self._pause()
            finished = False  # it resumes under this record
        conv = self._live.get(request_id) if request_id is not None else None
        if conv is None or conv.server != server_id:
            return  # stale (replica removed, or already released by a later acquire)
        if not finished and not aborted and generated_tokens is not None and generated_tokens <= conv.generated:
            return  # the previous chunk's release, overtaken by this chunk's acquire (no chunk ends empty)
        if finished is None:
            finished = True  # verl's plain client: one generate call is the whole turn
        if generated_tokens is None and not finished:
            generated_tokens = conv.generated  # a boundary without a count: the chunk's start
        # None (finished): verl's plain client reports no length; the policy learns nothing from the turn.
        self._release(conv, server_id, generated_tokens, finished)

    def add_servers(self, servers: dict[str, Any]) -> None:
        for server_id, handle in servers.items():
            self._handles[server_id] = handle
            self._inflight.setdefault(server_id, 0)
            self.policy.add_replica(server_id)
        self._wake_placed()

    def remove_servers(self, server_ids: list[str]) -> list[str]:
        """Returns the request ids that were running there; their clients re-acquire them."""
        orphans: list[str] = []
        for server_id in server_ids:
            if server_id not in self._handles:
                continue
            orphans += self.policy.remove_replica(server_id)
            del self._handles[server_id]
            self._inflight.pop(server_id, None)
            self._open_releases.pop(server_id, None)
        for conv in (*self._live.values(), *self._sticky.values()):
            if conv.home in server_ids:
                conv.home = None
            if conv.server in server_ids:
                conv.server = None  # its releases from the dead replica are stale now
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
            "waiting": self._parked,
            "paused": not self._open.is_set(),
            "held": self._held,
            "pauses": self._pauses,
            "conversations": {"live": len(self._live), "sticky": len(self._sticky)},
            "acquires": self._acquires,
            "open_releases": dict(self._open_releases),
            "router_cpu_s": round(time.process_time() - self._cpu0_s, 4),
            "policy": self.policy.snapshot(),
        }

    def clear_sticky_cache(self) -> dict:
        """Forgets conversations whose turn finished. In-flight sequences keep their replica: moving them is
        the policy's call."""
        cleared = len(self._sticky)
        self._sticky.clear()
        return {"cleared_entries": cleared, "server_loads": dict(self._inflight)}

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    # ---- rollout_ext extras -----------------------------------------------------------------
    def chunk_tokens(self) -> int:
        """Continuation chunk size that ChunkedLLMServerClient asks for (0: generate in one piece)."""
        return self.config.chunk_tokens

    async def acquire_chunk(self, request_id: str, prompt_ids=None, sampling_params=None):
        """`acquire_server`, plus the tokens to run before the next boundary: `chunk_tokens` where the
        policy may move the sequence there, 0 (the rest in one piece) where it never will."""
        conv = await self._place_turn(request_id, prompt_ids, sampling_params)
        return conv.server, self._handles[conv.server], self.policy.next_chunk_tokens(request_id, self.config.chunk_tokens)

    def end_epoch(self) -> dict:
        """Call after each training step's rollout (patches/verl_epoch_end.py does, in verl jobs):
        the length predictor turns this batch into history. Returns counts so far: epochs closed,
        the policy's moves, turns finished and those whose length was reported, turns after a
        conversation's first, chunks aborted by a replica pause, and acquires."""
        predictor = getattr(self.policy, "predictor", None)
        if predictor is not None:
            predictor.end_epoch()
        self._group_sizes.clear()  # sample indices restart with the next batch
        self._epochs += 1
        return {"epochs": self._epochs, "moves": self.policy.moves, "finished": self._finished,
                "lengths": self._lengths, "later_turns": self._later_turns, "aborts": self._aborts,
                "acquires": self._acquires}

    def conversation(self, request_id: str) -> dict | None:
        """What the router keeps of a request id: its turns, group and the replica its last chunk ran on."""
        conv = self._live.get(request_id) or self._sticky.get(request_id)
        if conv is None:
            return None
        return {"turns": conv.turns, "group": conv.group, "sample": conv.sample, "replica": conv.home,
                "finished": conv.finished}

    # ---- internals --------------------------------------------------------------------------
    def _turn_for(self, request_id: str, prompt_ids, sampling_params) -> _Conversation:
        conv = self._live.get(request_id)
        if conv is not None:
            return conv
        ids = list(prompt_ids) if prompt_ids is not None else []
        conv = self._sticky.pop(request_id, None)  # a later turn
        self._later_turns += conv is not None
        if conv is None:
            group = prompt_hash(ids)
            sample = self._group_sizes.get(group, 0)
            self._group_sizes[group] = sample + 1
            self._group_sizes.move_to_end(group)
            if len(self._group_sizes) > MAX_GROUPS:
                self._group_sizes.popitem(last=False)
            conv = _Conversation(request_id, group, sample)
        self._live[request_id] = conv
        max_tokens = (sampling_params or {}).get("max_tokens") or (sampling_params or {}).get("max_new_tokens")
        conv.turns += 1
        conv.prompt_len, conv.generated, conv.finished = len(ids), 0, False
        self.policy.submit(Request(request_id, conv.group, conv.sample, len(ids),
                                   int(max_tokens or self.config.default_max_tokens), conv.group),
                           home=conv.home)
        return conv

    def _release(self, conv: _Conversation, server_id: str, generated: int | None, finished: bool) -> None:
        conv.server, conv.finished = None, finished
        if generated is not None:
            conv.generated = generated
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1
        self.policy.release(conv.request_id, server_id, generated, finished, time.monotonic())
        if finished:
            self._finished += 1
            self._lengths += generated is not None
            self._sticky[conv.request_id] = self._live.pop(conv.request_id)
            if len(self._sticky) > STICKY_CONVERSATIONS:
                self._sticky.popitem(last=False)
        else:
            self._open_releases[server_id] = self._open_releases.get(server_id, 0) + 1
        self._wake_placed()

    def _pause(self) -> None:
        """Place nothing until every replica's gate is open again (see the module docstring)."""
        if not self._open.is_set():
            return
        self._open.clear()
        self._pauses += 1
        try:
            self._reopener = asyncio.get_running_loop().create_task(self._reopen_when_gates_open())
        except RuntimeError:
            self._reopen()  # no event loop (the class driven in one process): nothing can be waited for

    async def _reopen_when_gates_open(self) -> None:
        while not all(await asyncio.gather(*(_gate_open(h) for h in list(self._handles.values())))):
            await asyncio.sleep(GATE_POLL_S)
        self._reopen()

    def _reopen(self) -> None:
        self._open.set()
        self._wake_placed()

    def _wake_placed(self) -> None:
        if not self._open.is_set():
            return  # the policy keeps its placements until the replicas reopen
        for request_id, server_id in self.policy.take_ready():
            conv = self._live.get(request_id)
            if conv is None or conv.waiter is None:
                continue
            waiter, conv.waiter = conv.waiter, None
            if not waiter.done():
                waiter.set_result(server_id)


async def _gate_open(handle) -> bool:
    """A replica server's submission gate; verl's own servers, and dead ones, count as open."""
    try:
        return bool(await handle.submission_open.remote())
    except (AttributeError, ray.exceptions.RayError):
        return True


# Every parked acquire holds one of the actor's concurrent calls while it waits (see the module doc).
MAX_CONCURRENT_CALLS = 1_000_000
TailAwareRouterActor = ray.remote(max_concurrency=MAX_CONCURRENT_CALLS)(TailAwareRouter)
