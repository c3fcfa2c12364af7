"""Balancing policy API and the simple policies (round_robin, verl_default, oracle_lpt).

One policy object is driven the same way by the simulator and by a verl router actor:

    policy.add_replica(replica_id)
    policy.submit(Request(...))                       # once per sequence
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

A chunk is one acquire/release pair. The policy decides at each acquire: the same replica is
cheap (prefix cache), another one costs a re-prefill of prompt + generated tokens.

Load of a replica = KV tokens resident + predicted decode tokens remaining of its in-flight
requests (not a request count). The policy never sees true lengths; only `oracle_lpt` is given
them explicitly, through its predictor. Everything is deterministic for a fixed seed.
"""

from __future__ import annotations

import heapq
import itertools
import random

from rollout_ext.balance.request import Request


class Policy:
    name = "base"

    def __init__(self, *, predictor=None, slots_per_replica: int = 256, seed: int = 0) -> None:
        if slots_per_replica < 1:
            raise ValueError(f"slots_per_replica must be >= 1, got {slots_per_replica}")
        self.predictor = predictor
        self.slots_per_replica = slots_per_replica
        self.rng = random.Random(seed)
        self.replicas: dict[str, dict[str, None]] = {}  # replica -> in-flight request ids
        self.load_tokens: dict[str, float] = {}  # replica -> KV resident + predicted remaining
        self.requests: dict[str, Request] = {}
        self.generated: dict[str, int] = {}
        self.where: dict[str, str] = {}  # in-flight request -> replica
        self.home: dict[str, str] = {}  # request -> last replica it ran on (sticky)
        self.finished: set[str] = set()
        self.moves = 0
        self.clock_s: float | None = None  # the caller's clock at its latest acquire or release
        self._contrib: dict[str, float] = {}  # in-flight request -> its share of load_tokens
        self._ready: list[tuple[str, str]] = []

    # ---- membership -----------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        if replica_id in self.replicas:
            return
        self.replicas[replica_id] = {}
        self.load_tokens[replica_id] = 0.0

    def remove_replica(self, replica_id: str) -> list[str]:
        if replica_id not in self.replicas:
            return []
        orphans = list(self.replicas[replica_id])
        for rid in orphans:
            self._unplace(rid)
        del self.replicas[replica_id]
        del self.load_tokens[replica_id]
        for rid in [r for r, rep in self.home.items() if rep == replica_id]:
            del self.home[rid]
        return orphans

    # ---- request flow ---------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} submitted twice")
        self.requests[request.request_id] = request
        self.generated[request.request_id] = 0

    def acquire(self, request_id: str, generated_tokens: int, now_s: float | None = None) -> str | None:
        if now_s is not None:
            self.clock_s = now_s
        if request_id not in self.requests:
            raise KeyError(f"acquire of unknown request {request_id}")
        if request_id in self.finished:
            raise ValueError(f"acquire of finished request {request_id}")
        if request_id in self.where:
            return self.where[request_id]  # parked earlier and placed since, or a repeated call
        if not self.replicas:
            raise RuntimeError("no replicas registered")
        self.generated[request_id] = generated_tokens
        replica = self._choose(request_id)
        if replica is not None:
            home = self.home.get(request_id)
            if home is not None and home != replica and generated_tokens > 0:
                self.moves += 1
            self._place(request_id, replica)
        return replica

    def release(self, request_id: str, replica_id: str, generated_tokens: int | None, finished: bool,
                now_s: float | None = None) -> None:
        if generated_tokens is None and not finished:
            raise ValueError(f"release of {request_id}: generated_tokens=None is allowed only with finished=True")
        if now_s is not None:
            self.clock_s = now_s
        if self.where.get(request_id) != replica_id:
            return  # stale: the replica was removed and the request re-dispatched
        self._unplace(request_id)
        # A length nobody reported (None) must not teach the predictor a length of 0.
        if generated_tokens is not None:
            self.generated[request_id] = generated_tokens
            if self.predictor is not None:
                self.predictor.observe(self.requests[request_id], generated_tokens, finished)
        if finished:
            self.finished.add(request_id)
            self.home.pop(request_id, None)
        self._on_release(request_id, replica_id, finished)

    def take_ready(self) -> list[tuple[str, str]]:
        self._pump()
        ready, self._ready = self._ready, []
        return ready

    def next_chunk_tokens(self, request_id: str, chunk_tokens: int) -> int:
        """Tokens the placed request runs before its next boundary (0: the rest, in one piece)."""
        return chunk_tokens if self._may_move(request_id) else 0

    def _may_move(self, request_id: str) -> bool:
        """Whether the policy may send this sequence's next chunk elsewhere than its home replica."""
        return False

    def snapshot(self) -> dict:
        out = {
            "policy": self.name,
            "replicas": {
                rep: {"in_flight": len(rids), "load_tokens": round(self.load_tokens[rep], 1)}
                for rep, rids in self.replicas.items()
            },
            "in_flight": len(self.where),
            "finished": len(self.finished),
            "moves": self.moves,
        }
        if self.predictor is not None:
            out["predictor"] = self.predictor.calibration()
        return out

    # ---- hooks for subclasses -------------------------------------------------------------
    def _choose(self, request_id: str) -> str | None:
        raise NotImplementedError

    def _on_release(self, request_id: str, replica_id: str, finished: bool) -> None:
        pass

    def _pump(self) -> None:
        pass

    # ---- bookkeeping ----------------------------------------------------------------------
    def remaining(self, request_id: str) -> float:
        if self.predictor is None:
            return 0.0
        return self.predictor.remaining_tokens(self.requests[request_id], self.generated[request_id])

    def _place(self, request_id: str, replica_id: str) -> None:
        req = self.requests[request_id]
        contrib = req.prompt_len + self.generated[request_id] + self.remaining(request_id)
        self.where[request_id] = replica_id
        self.home[request_id] = replica_id
        self.replicas[replica_id][request_id] = None
        self._contrib[request_id] = contrib
        self.load_tokens[replica_id] += contrib

    def _unplace(self, request_id: str) -> None:
        replica_id = self.where.pop(request_id)
        del self.replicas[replica_id][request_id]
        # Clamp: float round-off must never make a load negative.
        self.load_tokens[replica_id] = max(0.0, self.load_tokens[replica_id] - self._contrib.pop(request_id))
        if not self.replicas[replica_id]:
            self.load_tokens[replica_id] = 0.0

    def _sticky(self, request_id: str) -> str | None:
        home = self.home.get(request_id)
        return home if home in self.replicas else None


class RoundRobinPolicy(Policy):
    """Each new sequence goes to the next replica in turn; continuations stay put."""

    name = "round_robin"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._turn = 0

    def _choose(self, request_id: str) -> str | None:
        home = self._sticky(request_id)
        if home is not None:
            return home
        order = list(self.replicas)
        replica = order[self._turn % len(order)]
        self._turn += 1
        return replica


class VerlDefaultPolicy(Policy):
    """verl 0.9.1 GlobalRequestLoadBalancer: sticky, else fewest in-flight requests (random tie)."""

    name = "verl_default"

    def _choose(self, request_id: str) -> str | None:
        home = self._sticky(request_id)
        if home is not None:
            return home
        fewest = min(len(rids) for rids in self.replicas.values())
        return self.rng.choice([rep for rep, rids in self.replicas.items() if len(rids) == fewest])


class CentralQueuePolicy(Policy):
    """A central longest-predicted-first queue; work leaves it only for a replica with a free slot.

    Holding work back (late binding) means the next long sequence goes to whichever replica frees
    up first. Continuations stay sticky. `_pick` chooses among replicas with a free slot; this
    base class picks the least load (classic LPT).
    """

    name = "central_lpt"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._queue: list[tuple[float, int, str]] = []  # (-priority, tiebreak, request id)
        self._queued: dict[str, int] = {}  # request id -> live tiebreak (lazy deletion)
        self._counter = itertools.count()

    def remove_replica(self, replica_id: str) -> list[str]:
        return super().remove_replica(replica_id)

    def _choose(self, request_id: str) -> str | None:
        home = self._sticky(request_id)
        if home is not None and self.generated[request_id] > 0:
            return self._continue(request_id, home)
        self._enqueue(request_id)
        return None

    def _continue(self, request_id: str, home: str) -> str | None:
        return home

    def _priority(self, request_id: str) -> float:
        return self.generated[request_id] + self.remaining(request_id)

    def _enqueue(self, request_id: str) -> None:
        tiebreak = next(self._counter)
        self._queued[request_id] = tiebreak
        heapq.heappush(self._queue, (-self._priority(request_id), tiebreak, request_id))

    def _requeue(self, request_id: str) -> None:
        """Re-key a queued request after its prediction changed."""
        if request_id in self._queued:
            self._enqueue(request_id)

    def waiting(self) -> int:
        return len(self._queued)

    def _pump(self) -> None:
        free = [rep for rep, rids in self.replicas.items() if len(rids) < self.slots_per_replica]
        while self._queue and free:
            _, tiebreak, rid = heapq.heappop(self._queue)
            if self._queued.get(rid) != tiebreak:
                continue
            del self._queued[rid]
            self._assign(rid, self._pick(rid, free), free)

    def _assign(self, request_id: str, replica_id: str, free: list[str]) -> None:
        """Place a parked request; a replica whose slots are now full leaves `free`."""
        self._place(request_id, replica_id)
        self._ready.append((request_id, replica_id))
        if len(self.replicas[replica_id]) >= self.slots_per_replica:
            free.remove(replica_id)

    def _pick(self, request_id: str, free: list[str]) -> str:
        return min(free, key=self.load_tokens.__getitem__)

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["waiting"] = self.waiting()
        return out


class OracleLPTPolicy(CentralQueuePolicy):
    """Longest-processing-time-first with the true lengths, admission only (a reference)."""

    name = "oracle_lpt"
