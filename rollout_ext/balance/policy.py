"""Balancing policy API and the simple policies (round_robin, verl_default, oracle_lpt).

One policy object is driven the same way by the simulator and by a verl router actor:

    policy.add_replica(replica_id)
    policy.submit(Request(...), home=None)            # once per sequence (home: see below)
    replica = policy.acquire(request_id, generated_tokens, now_s=None)
        # -> replica id: send the next chunk there now
        # -> None: parked; the policy places it later (see take_ready)
    policy.release(request_id, replica_id, generated_tokens, finished, now_s=None)
        # after every chunk; finished=True when the sequence ended (EOS or max_tokens).
        # generated_tokens=None: the caller does not know (verl's plain client releases with the
        # request id alone); the request leaves its replica and nothing is learned from it
        # now_s: the caller's clock in seconds (simulated time in the simulator, wall time in
        # the router). Optional; a policy that learns its replicas' speed needs it.
    policy.take_ready() -> [(request_id, replica_id), ...]
        # parked requests placed since the last call; call it after every acquire/release
        # and after add_replica. Calling acquire again on a parked request also returns
        # its replica once one was chosen.
    policy.remove_replica(replica_id) -> [request_id, ...]
        # in-flight requests of that replica; the caller re-acquires each of them
    policy.snapshot() -> dict                          # status for logs and get_status()
    policy.next_chunk_tokens(request_id, chunk_tokens) -> int
        # for a placed request: the tokens to run before its next boundary. chunk_tokens where
        # the policy may move it at that boundary, 0 (the rest in one piece) where it never will:
        # a chunk boundary costs a round trip and a re-schedule on a real engine.

A chunk is one acquire/release pair. A finished request leaves the policy: its id may be submitted
again, as a later turn of a conversation, with `home` the replica its earlier turn ran on (it holds
the conversation's prefix). A later turn starts there; like any sequence, it may move at a chunk
boundary, once the policy has measured it.

State: one `Seq` per live request and one `Replica` per replica (as nano-vllm keeps one `Sequence`);
nothing outlives its request, so a long job's policy holds what is live and a few counters.
 The policy decides at each acquire: the same replica is
cheap (prefix cache), another one costs a re-prefill of prompt + generated tokens.

Load of a replica = KV tokens resident + predicted decode tokens remaining of its in-flight
requests (not a request count). The policy never sees true lengths; only `oracle_lpt` is given
them explicitly, through its predictor. Everything is deterministic for a fixed seed.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from rollout_ext.balance.request import Request

# The central queue deletes lazily; once stale entries outnumber live ones by this much, it is rebuilt.
STALE_QUEUE_FACTOR = 2


@dataclass(slots=True, eq=False)
class Seq:
    """One live request, as a policy keeps it: created by `submit`, dropped when it finishes. The fields
    after `queued_tokens` are the tail-aware policies' (tail_aware.py)."""

    request: Request
    generated: int = 0  # tokens generated, as of its last acquire or release
    replica: str | None = None  # where its chunk runs now (None: queued, or between chunks)
    home: str | None = None  # the replica it last ran on: it holds its KV (prefix cache)
    load_tokens: float = 0.0  # its share of its replica's load while placed
    predicted_tokens: float | None = None  # the total length predicted at its first placement
    queue_tiebreak: int | None = None  # its live entry in the central queue (None: not queued)
    queued_tokens: float = 0.0  # its predicted total length while queued
    moves: int = 0  # times it moved to another replica
    # As of its placement: predicted remaining tokens, how fast that falls per generated token (alpha),
    # its context, and its replica's decode steps (tail_aware.py, `ReplicaLoad`).
    placed_rem_tokens: float = 0.0
    alpha: float = 1.0
    placed_ctx_tokens: float = 0.0
    placed_step: float = 0.0
    last_placed_generated: int | None = None  # generated tokens at its previous placement
    chunk_start: object | None = None  # the instant its running chunk started at (tail_aware.py, `_Instant`)
    chunk_start_generated: int = 0  # generated tokens at that start
    released_s: float | None = None  # its last unfinished release, on the caller's clock

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def queued(self) -> bool:
        return self.queue_tiebreak is not None


@dataclass(slots=True, eq=False)
class Replica:
    """One replica, as a policy keeps it."""

    replica_id: str
    running: dict[str, Seq] = field(default_factory=dict)  # its in-flight requests, in placement order
    load_tokens: float = 0.0  # KV resident + predicted remaining of its in-flight requests

    @property
    def batch(self) -> int:
        return len(self.running)


class Policy:
    name = "base"

    def __init__(self, *, predictor=None, slots_per_replica: int = 256, seed: int = 0) -> None:
        if slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be >= 1, got {slots_per_replica}")
        self.predictor = predictor
        self.slots_per_replica = slots_per_replica
        self.rng = random.Random(seed)
        self.replicas: dict[str, Replica] = {}
        self.seqs: dict[str, Seq] = {}  # live requests
        self.in_flight = 0  # requests placed on a replica now
        self.finished = 0  # requests finished, ever
        self.moves = 0
        self.clock_s: float | None = None  # the caller's clock at its latest acquire or release
        self._ready: list[tuple[str, str]] = []

    # ---- membership -----------------------------------------------------------------------
    def _new_replica(self, replica_id: str) -> Replica:
        return Replica(replica_id)

    def add_replica(self, replica_id: str) -> None:
        if replica_id not in self.replicas:
            self.replicas[replica_id] = self._new_replica(replica_id)

    def remove_replica(self, replica_id: str) -> list[str]:
        rep = self.replicas.get(replica_id)
        if rep is None:
            return []
        orphans = list(rep.running)
        for rid in orphans:
            self._unplace(self.seqs[rid])
        del self.replicas[replica_id]
        for seq in self.seqs.values():
            if seq.home == replica_id:
                seq.home = None
        return orphans

    # ---- request flow ---------------------------------------------------------------------
    def submit(self, request: Request, home: str | None = None) -> Seq:
        """A new request; `home`: the replica that holds its prefix (a later turn of a conversation)."""
        if request.request_id in self.seqs:
            raise ValueError(f"request {request.request_id} submitted twice")
        seq = Seq(request, home=home if home in self.replicas else None)
        self.seqs[request.request_id] = seq
        return seq

    def acquire(self, request_id: str, generated_tokens: int, now_s: float | None = None) -> str | None:
        if now_s is not None:
            self.clock_s = now_s
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"acquire of request {request_id}: not live (never submitted, or finished)")
        if seq.replica is not None:
            return seq.replica  # parked earlier and placed since, or a repeated call
        if not self.replicas:
            raise RuntimeError("no replicas registered")
        seq.generated = generated_tokens
        replica = self._choose(seq)
        if replica is not None:
            if seq.home is not None and seq.home != replica and generated_tokens > 0:
                self.moves += 1
            self._place(seq, replica)
        return replica

    def release(self, request_id: str, replica_id: str, generated_tokens: int | None, finished: bool,
                now_s: float | None = None) -> None:
        if generated_tokens is None and not finished:
            raise ValueError(f"release of {request_id}: generated_tokens=None is allowed only with finished=True")
        if now_s is not None:
            self.clock_s = now_s
        seq = self.seqs.get(request_id)
        if seq is None or seq.replica != replica_id:
            return  # stale: the replica was removed and the request re-dispatched
        self._unplace(seq)
        # A length nobody reported (None) must not teach the predictor a length of 0.
        if generated_tokens is not None:
            seq.generated = generated_tokens
            if self.predictor is not None:
                self.predictor.observe(seq.request, generated_tokens, finished, predicted_tokens=seq.predicted_tokens)
        if finished:
            del self.seqs[request_id]
            self.finished += 1
        self._on_release(seq, replica_id, finished)

    def take_ready(self) -> list[tuple[str, str]]:
        self._pump()
        ready, self._ready = self._ready, []
        return ready

    def next_chunk_tokens(self, request_id: str, chunk_tokens: int) -> int:
        """Tokens the placed request runs before its next boundary (0: the rest, in one piece)."""
        seq = self.seqs.get(request_id)
        return chunk_tokens if seq is not None and self._may_move(seq) else 0

    def _may_move(self, seq: Seq) -> bool:
        """Whether the policy may send this sequence's next chunk elsewhere than its home replica."""
        return False

    def snapshot(self) -> dict:
        out = {
            "policy": self.name,
            "replicas": {
                rid: {"in_flight": rep.batch, "load_tokens": round(rep.load_tokens, 1)}
                for rid, rep in self.replicas.items()
            },
            "in_flight": self.in_flight,
            "live": len(self.seqs),
            "finished": self.finished,
            "moves": self.moves,
        }
        if self.predictor is not None:
            out["predictor"] = self.predictor.calibration()
        return out

    # ---- hooks for subclasses -------------------------------------------------------------
    def _choose(self, seq: Seq) -> str | None:
        raise NotImplementedError

    def _on_release(self, seq: Seq, replica_id: str, finished: bool) -> None:
        pass

    def _pump(self) -> None:
        pass

    # ---- bookkeeping ----------------------------------------------------------------------
    def remaining(self, seq: Seq) -> float:
        if self.predictor is None:
            return 0.0
        return self.predictor.remaining_tokens(seq.request, seq.generated)

    def _place(self, seq: Seq, replica_id: str) -> None:
        rep = self.replicas[replica_id]
        rem = self.remaining(seq)
        if seq.generated == 0 and seq.predicted_tokens is None:
            seq.predicted_tokens = rem  # what the predictor's calibration compares with the true length
        contrib = seq.request.prompt_len + seq.generated + rem
        seq.replica = seq.home = replica_id
        rep.running[seq.request_id] = seq
        seq.load_tokens = contrib
        rep.load_tokens += contrib
        self.in_flight += 1

    def _unplace(self, seq: Seq) -> None:
        rep = self.replicas[seq.replica]
        seq.replica = None
        del rep.running[seq.request_id]
        # Clamp: float round-off must never make a load negative.
        rep.load_tokens = max(0.0, rep.load_tokens - seq.load_tokens)
        seq.load_tokens = 0.0
        if not rep.running:
            rep.load_tokens = 0.0
        self.in_flight -= 1

    def _sticky(self, seq: Seq) -> str | None:
        return seq.home if seq.home in self.replicas else None


class RoundRobinPolicy(Policy):
    """Each new sequence goes to the next replica in turn; continuations stay put."""

    name = "round_robin"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._turn = 0

    def _choose(self, seq: Seq) -> str | None:
        home = self._sticky(seq)
        if home is not None:
            return home
        order = list(self.replicas)
        replica = order[self._turn % len(order)]
        self._turn += 1
        return replica


class VerlDefaultPolicy(Policy):
    """verl 0.9.1 GlobalRequestLoadBalancer: sticky, else fewest in-flight requests (random tie)."""

    name = "verl_default"

    def _choose(self, seq: Seq) -> str | None:
        home = self._sticky(seq)
        if home is not None:
            return home
        fewest = min(rep.batch for rep in self.replicas.values())
        return self.rng.choice([rid for rid, rep in self.replicas.items() if rep.batch == fewest])


class CentralQueuePolicy(Policy):
    """A central longest-predicted-first queue; work leaves it only for a replica with a free slot.

    Holding work back (late binding) means the next long sequence goes to whichever replica frees
    up first. Continuations, and later turns of a conversation, go to their home replica
    (`_continue`). `_pick` chooses among replicas with a free slot; this base class picks the least
    load (classic LPT).
    """

    name = "central_lpt"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._queue: list[tuple[float, int, Seq]] = []  # (-priority, tiebreak, request): lazy deletion
        self._waiting = 0  # queued requests
        self._queued_tokens = 0.0  # their predicted total lengths
        self._counter = itertools.count()

    def _choose(self, seq: Seq) -> str | None:
        home = self._sticky(seq)
        if home is not None:
            return self._continue(seq, home)
        self._enqueue(seq)
        return None

    def _continue(self, seq: Seq, home: str) -> str | None:
        return home

    def _priority(self, seq: Seq) -> float:
        return seq.generated + self.remaining(seq)

    def _enqueue(self, seq: Seq) -> None:
        if seq.queue_tiebreak is None:
            self._waiting += 1
        seq.queue_tiebreak = tiebreak = next(self._counter)
        priority = self._priority(seq)
        self._queued_tokens += priority - seq.queued_tokens
        seq.queued_tokens = priority
        heapq.heappush(self._queue, (-priority, tiebreak, seq))
        self._queue = compact_heap(self._queue, self._waiting)

    def _dequeue(self, seq: Seq) -> None:
        seq.queue_tiebreak = None
        self._waiting -= 1
        self._queued_tokens -= seq.queued_tokens
        seq.queued_tokens = 0.0
        if not self._waiting:
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Nothing is queued: every entry left in the queue is stale."""
        self._queue.clear()

    def _requeue(self, seq: Seq) -> None:
        """Re-key a queued request after its prediction changed."""
        if seq.queued:
            self._enqueue(seq)

    def waiting(self) -> int:
        return self._waiting

    def _free(self) -> list[Replica]:
        return [rep for rep in self.replicas.values() if len(rep.running) < self.slots_per_replica]

    def _pump(self) -> None:
        free = self._free() if self._queue else []
        while self._queue and free:
            _, tiebreak, seq = heapq.heappop(self._queue)
            if seq.queue_tiebreak != tiebreak:
                continue
            self._dequeue(seq)
            self._assign(seq, self._pick(seq, free), free)

    def _assign(self, seq: Seq, rep: Replica, free: list[Replica]) -> None:
        """Place a parked request; a replica whose slots are now full leaves `free`."""
        self._place(seq, rep.replica_id)
        self._ready.append((seq.request_id, rep.replica_id))
        if rep.batch >= self.slots_per_replica:
            free.remove(rep)

    def _pick(self, seq: Seq, free: list[Replica]) -> Replica:
        return min(free, key=lambda rep: rep.load_tokens)

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["waiting"] = self.waiting()
        return out


def compact_heap(heap: list, live: int) -> list:
    """`heap` without its stale entries (entry[2].queue_tiebreak != entry[1]) once they dominate it.
    Entries are unique (priority, tiebreak), so the live ones pop in the same order either way."""
    if len(heap) <= STALE_QUEUE_FACTOR * live + 64:
        return heap
    kept = [entry for entry in heap if entry[2].queue_tiebreak == entry[1]]
    heapq.heapify(kept)
    return kept


class OracleLPTPolicy(CentralQueuePolicy):
    """Longest-processing-time-first with the true lengths, admission only (a reference)."""

    name = "oracle_lpt"
