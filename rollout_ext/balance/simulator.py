"""Discrete-event simulator of R decode replicas driving a balancing policy through its public API.

Each replica is a vLLM-like engine: a local FCFS waiting queue, a running batch capped by
`max_num_seqs` and by KV capacity (with recompute preemption of the newest sequence when the
next step would not fit), and decode steps timed by `StepModel`. Admitting a sequence costs a
prefill of its prompt (plus generated tokens for a moved or preempted one: the re-prefill).

Speed: a replica is never stepped token by token. Between its events (next finish, next chunk
boundary, KV full, or an admission request from outside) the batch is fixed and KV grows by B
tokens a step, so the time of n steps is an arithmetic series (`StepModel.steps_s`). Events of
all replicas sit in one heapq; stale ones are skipped by a version number.

Chunks: every `chunk_tokens` generated tokens a sequence returns to the caller, which releases
it and acquires again (like the chunked-continuation router), if the policy may move it there
(`policy.next_chunk_tokens`); otherwise it runs to its end in one piece. If the policy answers another
replica, the sequence moves there and pays a re-prefill; if it answers None, it is parked
until the policy places it (`take_ready`).

Replica speeds (`speeds`, default all 1): real replicas are not all alike (a degraded device, a
throttled node, a noisy neighbour on the host). Replica i runs every step and prefill `speeds[i]`
times as long as the step model says; `REPLICA_SPEEDS` names the profiles the benches sweep.

Round trip (`round_trip_s`, default 0): on real replicas work reaches an engine only after the
caller hears the policy's answer and sends it (acquire, then the generate call). With
round_trip_s > 0, every dispatch arrives at its replica's queue that long after the policy placed
it: a fresh request, a parked one placed by `take_ready`, a moved chunk, and a chunk that stays
home, which leaves its batch at the boundary and rejoins at the back of the replica's queue
(prefix cache: no prefill), as a new request does in vLLM. Work that waits in an engine's own
queue starts with no round trip; work parked in the policy pays one after its slot frees.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rollout_ext.balance.request import Request
from rollout_ext.balance.step_model import StepModel, scaled
from rollout_ext.balance.workload import Workload


def _one_slow(replicas: int) -> list[float]:
    # The slow one sits mid-list: a policy's tie-breaks favour the first replicas.
    return [1.5 if i == replicas // 2 else 1.0 for i in range(replicas)]


# Per-replica step-time factors, by name: a function of the replica count.
REPLICA_SPEEDS = {
    "equal": lambda replicas: [1.0] * replicas,
    "one_slow": _one_slow,  # one replica 1.5x slower (a degraded device)
    "spread": lambda replicas: [0.8 + 0.45 * i / max(1, replicas - 1) for i in range(replicas)],  # 0.8x .. 1.25x
}


@dataclass
class SimResult:
    makespan_s: float
    moves: int
    preemptions: int
    finish_s: dict[str, float]
    busy_intervals: dict[str, list[tuple[float, float]]]  # replica -> [(start, end)] busy
    placements: int  # acquire answers that started or moved a chunk on a replica
    snapshot: dict = field(default_factory=dict)
    start_s: dict[str, float] = field(default_factory=dict)  # first admission (prefill start)
    move_prefill_tokens: int = 0  # prompt + generated tokens re-prefilled because of moves
    boundaries: int = 0  # chunk ends with the sequence unfinished (each one a release and an acquire)

    def busy_count_timeline(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, busy replicas from that time on), a step function."""
        deltas: dict[float, int] = {}
        for spans in self.busy_intervals.values():
            for start, end in spans:
                if end > start:
                    deltas[start] = deltas.get(start, 0) + 1
                    deltas[end] = deltas.get(end, 0) - 1
        times = np.array(sorted(deltas))
        counts = np.cumsum([deltas[t] for t in times])
        return times, counts

    def tail_fraction(self, replicas: int) -> float:
        """Share of wall time with fewer than half of the replicas busy."""
        times, counts = self.busy_count_timeline()
        if self.makespan_s <= 0 or times.size == 0:
            return 0.0
        ends = np.append(times[1:], self.makespan_s)
        below = (counts < replicas / 2) & (ends > times)
        low = float(np.sum((ends - times)[below]))
        low += float(times[0])  # before the first start nothing is busy
        return low / self.makespan_s

    def idle_replica_s(self, replicas: int) -> float:
        busy = sum(end - start for spans in self.busy_intervals.values() for start, end in spans)
        return replicas * self.makespan_s - busy


class _Seq:
    __slots__ = ("rid", "prompt", "length", "generated", "join_step", "target", "prefill")

    def __init__(self, rid: str, prompt: int, length: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.length = length
        self.generated = 0  # at join_step
        self.join_step = 0
        self.target = 0  # replica step at which it finishes or hits a chunk boundary
        self.prefill = prompt  # tokens to prefill when admitted next


class SimReplica:
    __slots__ = ("rid", "model", "time_s", "step", "kv", "running", "waiting", "targets", "version",
                 "event_step", "busy_since", "alive")

    def __init__(self, rid: str, model: StepModel) -> None:
        self.rid = rid
        self.model = model  # this replica's step times
        self.time_s = 0.0
        self.step = 0
        self.kv = 0
        self.running: dict[str, _Seq] = {}  # admission order (newest last: preempted first)
        self.waiting: deque[_Seq] = deque()
        self.targets: list[tuple[int, str]] = []
        self.version = 0
        self.event_step = -1
        self.busy_since: float | None = None
        self.alive = True


class Simulator:
    def __init__(self, workload: Workload, policy, replicas: int, *, model: StepModel | None = None,
                 chunk_tokens: int = 2048, kv_watermark: float = 0.01, clock: bool = True,
                 round_trip_s: float = 0.0, speeds=None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        speeds = [1.0] * replicas if speeds is None else [float(x) for x in speeds]
        if len(speeds) != replicas or not all(x > 0 for x in speeds):
            raise ValueError(f"speeds must be {replicas} factors > 0 (one per replica), got {speeds}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if not round_trip_s >= 0:
            raise ValueError(f"round_trip_s must be >= 0 seconds, got {round_trip_s}")
        self.round_trip_s = round_trip_s
        self._arriving: dict[tuple[float, str], list[str]] = {}  # (arrival s, replica) -> request ids
        self.workload = workload
        self.policy = policy
        self.model = model or StepModel()
        self.chunk_tokens = chunk_tokens
        self.clock = clock  # pass simulated time to the policy (False: a policy without a clock)
        self.kv_limit = int(self.model.kv_capacity_tokens * (1 - kv_watermark))
        self.reps = {f"r{i}": SimReplica(f"r{i}", scaled(self.model, speed)) for i, speed in enumerate(speeds)}
        self.seqs = {
            rid: _Seq(rid, int(p), int(n))
            for rid, p, n in zip(workload.request_ids, workload.prompt_tokens, workload.lengths)
        }
        self._events: list = []
        self._tiebreak = itertools.count()
        self.finish_s: dict[str, float] = {}
        self.busy: dict[str, list[tuple[float, float]]] = {rid: [] for rid in self.reps}
        self.moves = 0
        self.preemptions = 0
        self.placements = 0
        self._removals: list[tuple[float, str]] = []
        self.start_s: dict[str, float] = {}
        self.move_prefill_tokens = 0
        self.boundaries = 0

    def remove_replica_at(self, time_s: float, replica_id: str) -> None:
        """Schedule a replica failure/scale-down: the policy must re-dispatch its work."""
        self._removals.append((time_s, replica_id))

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        w = self.workload
        for rid in self.reps:
            self.policy.add_replica(rid)
        for i, rid in enumerate(w.request_ids):
            self.policy.submit(Request(rid, w.group_keys[i], int(w.sample_index[i]),
                                       int(w.prompt_tokens[i]), int(w.config.cap_tokens), w.prompt_hashes[i]))
        touched: set = set()
        for rid in w.request_ids:
            replica = self.policy.acquire(rid, 0, self._now(0.0))
            if replica is not None:
                self._dispatch(rid, replica, touched, 0.0)
        self._drain_ready(0.0, None, touched)
        for time_s, replica_id in self._removals:
            heapq.heappush(self._events, (time_s, next(self._tiebreak), "remove", replica_id, 0))

        now = 0.0
        while self._events:
            now, _, kind, replica_id, version = heapq.heappop(self._events)
            if kind == "remove":
                self._remove(replica_id, now)
                continue
            if kind == "arrive":
                self._arrive(replica_id, now)
                continue
            rep = self.reps[replica_id]
            if not rep.alive or version != rep.version:
                continue
            self._on_event(rep)

        missing = len(self.seqs) - len(self.finish_s)
        if missing:
            raise RuntimeError(f"simulation stalled: {missing} requests never finished (policy starved them)")
        makespan = max(self.finish_s.values()) if self.finish_s else 0.0
        return SimResult(makespan, self.moves, self.preemptions, self.finish_s, self.busy,
                         self.placements, self.policy.snapshot(), self.start_s, self.move_prefill_tokens,
                         self.boundaries)

    def _now(self, time_s: float) -> float | None:
        return time_s if self.clock else None

    # ---- replica mechanics ----------------------------------------------------------------
    def _advance(self, rep: SimReplica, steps: int) -> None:
        if steps <= 0:
            return
        batch = len(rep.running)
        rep.time_s += rep.model.steps_s(batch, rep.kv, steps)
        rep.kv += batch * steps
        rep.step += steps

    def _on_event(self, rep: SimReplica) -> None:
        self._advance(rep, rep.event_step - rep.step)
        now = rep.time_s
        touched: set = set()
        while rep.targets and rep.targets[0][0] <= rep.step:
            target, rid = heapq.heappop(rep.targets)
            seq = rep.running.get(rid)
            if seq is None or seq.target != target:
                continue  # stale entry: the sequence left this replica
            self._at_target(rep, seq, now, touched)
        self._preempt_if_full(rep)
        self._drain_ready(now, rep, touched)
        self._kick(rep, now)

    def _at_target(self, rep: SimReplica, seq: _Seq, now: float, touched: set) -> None:
        generated = seq.generated + rep.step - seq.join_step
        if generated >= seq.length:
            self._leave(rep, seq, generated)
            self.policy.release(seq.rid, rep.rid, generated, True, self._now(now))
            self.finish_s[seq.rid] = now
            return
        self.boundaries += 1
        self.policy.release(seq.rid, rep.rid, generated, False, self._now(now))
        replica = self.policy.acquire(seq.rid, generated, self._now(now))
        if replica == rep.rid:
            if self.round_trip_s == 0:
                seq.generated, seq.join_step = generated, rep.step
                self._set_target(rep, seq)
            else:  # it rejoins its own replica's queue after the round trip: a prefix-cache hit
                self._leave(rep, seq, generated)
                seq.prefill = 0
                self._dispatch(seq.rid, replica, touched, now)
            return
        self._leave(rep, seq, generated)
        seq.prefill = seq.prompt + generated  # the prefix cache of the old replica is lost
        if replica is not None:
            self.moves += 1
            self.move_prefill_tokens += seq.prefill
            self._dispatch(seq.rid, replica, touched, now)

    def _leave(self, rep: SimReplica, seq: _Seq, generated: int) -> None:
        del rep.running[seq.rid]
        rep.kv -= seq.prompt + generated
        seq.generated = generated

    def _set_target(self, rep: SimReplica, seq: _Seq) -> None:
        chunk = self.policy.next_chunk_tokens(seq.rid, self.chunk_tokens)
        left = seq.length - seq.generated
        to_boundary = (seq.generated // chunk + 1) * chunk - seq.generated if chunk > 0 else left
        seq.target = rep.step + min(left, to_boundary)
        heapq.heappush(rep.targets, (seq.target, seq.rid))

    def _preempt_if_full(self, rep: SimReplica) -> None:
        # The next step adds one token per running sequence; recompute-preempt the newest.
        while rep.running and rep.kv + len(rep.running) > self.model.kv_capacity_tokens:
            rid = next(reversed(rep.running))
            seq = rep.running[rid]
            self._leave(rep, seq, seq.generated + rep.step - seq.join_step)
            seq.prefill = seq.prompt + seq.generated
            rep.waiting.appendleft(seq)
            self.preemptions += 1

    def _admit(self, rep: SimReplica) -> None:
        prefill_tokens = 0
        while rep.waiting and len(rep.running) < self.model.max_num_seqs:
            seq = rep.waiting[0]
            need = seq.prompt + seq.generated
            if rep.running and rep.kv + need + len(rep.running) + 1 > self.kv_limit:
                break
            rep.waiting.popleft()
            rep.running[seq.rid] = seq
            rep.kv += need
            prefill_tokens += seq.prefill
            self.start_s.setdefault(seq.rid, rep.time_s)
            seq.prefill = 0
            seq.join_step = rep.step
            self._set_target(rep, seq)
        if prefill_tokens:
            rep.time_s += rep.model.prefill_s(prefill_tokens)

    def _kick(self, rep: SimReplica, now: float) -> None:
        """Admit waiting work and schedule the replica's next event (or mark it idle)."""
        if not rep.alive:
            return
        if not rep.running:
            rep.time_s = max(rep.time_s, now)
        self._admit(rep)
        rep.version += 1
        if not rep.running:
            if rep.busy_since is not None:
                self.busy[rep.rid].append((rep.busy_since, rep.time_s))
                rep.busy_since = None
            rep.event_step = -1
            return
        if rep.busy_since is None:
            rep.busy_since = now
        while rep.targets:
            target, rid = rep.targets[0]
            seq = rep.running.get(rid)
            if seq is not None and seq.target == target:
                break
            heapq.heappop(rep.targets)
        batch = len(rep.running)
        kv_full_steps = max(1, (self.model.kv_capacity_tokens - rep.kv) // batch)
        steps = min(rep.targets[0][0] - rep.step, kv_full_steps)
        self._schedule(rep, rep.step + max(1, steps))

    def _schedule(self, rep: SimReplica, step: int) -> None:
        rep.event_step = step
        time_s = rep.time_s + rep.model.steps_s(len(rep.running), rep.kv, step - rep.step)
        heapq.heappush(self._events, (time_s, next(self._tiebreak), "step", rep.rid, rep.version))

    def _dispatch(self, rid: str, replica_id: str, touched: set, now: float) -> None:
        self.placements += 1
        if self.round_trip_s > 0:
            # Dispatches of one instant to one replica arrive together, as one admission.
            key = (now + self.round_trip_s, replica_id)
            if key not in self._arriving:
                self._arriving[key] = []
                heapq.heappush(self._events, (key[0], next(self._tiebreak), "arrive", replica_id, 0))
            self._arriving[key].append(rid)
            return
        self.reps[replica_id].waiting.append(self.seqs[rid])
        touched.add(replica_id)

    def _arrive(self, replica_id: str, now: float) -> None:
        rids = self._arriving.pop((now, replica_id))
        rep = self.reps[replica_id]
        if not rep.alive:
            return  # the replica died meanwhile: the policy handed these back, and they were re-dispatched
        rep.waiting.extend(self.seqs[rid] for rid in rids)
        self._wake({replica_id}, now, None)

    def _wake(self, touched: set, now: float, current: SimReplica | None) -> None:
        """Replicas that got work: an idle one starts now; a busy one admits after its step."""
        for replica_id in sorted(touched):
            rep = self.reps[replica_id]
            if rep is current or not rep.alive:
                continue  # the current replica admits when its event finishes
            if not rep.running:
                self._kick(rep, now)
                continue
            done = rep.model.steps_within_s(len(rep.running), rep.kv, now - rep.time_s)
            step = rep.step + done + 1
            if step < rep.event_step:
                rep.version += 1
                self._schedule(rep, step)

    def _drain_ready(self, now: float, current: SimReplica | None, touched: set | None = None) -> None:
        touched = set() if touched is None else touched
        for rid, replica_id in self.policy.take_ready():
            self._dispatch(rid, replica_id, touched, now)
        self._wake(touched, now, current)

    def _remove(self, replica_id: str, now: float) -> None:
        rep = self.reps[replica_id]
        if not rep.alive:
            return
        if rep.running:
            done = rep.model.steps_within_s(len(rep.running), rep.kv, now - rep.time_s)
            self._advance(rep, min(done, max(0, rep.event_step - rep.step)))
        for seq in rep.running.values():
            seq.generated += rep.step - seq.join_step
            seq.prefill = seq.prompt + seq.generated
        for seq in rep.waiting:
            seq.prefill = seq.prompt + seq.generated
        rep.running.clear()
        rep.waiting.clear()
        rep.alive = False
        rep.version += 1
        if rep.busy_since is not None:
            self.busy[rep.rid].append((rep.busy_since, max(now, rep.busy_since)))
            rep.busy_since = None
        touched: set = set()
        for rid in self.policy.remove_replica(replica_id):
            seq = self.seqs[rid]
            seq.prefill = seq.prompt + seq.generated  # also one still on its way there
            replica = self.policy.acquire(rid, seq.generated, self._now(now))
            if replica is not None:
                self._dispatch(rid, replica, touched, now)
        self._drain_ready(now, None, touched)


def simulate(workload: Workload, policy, replicas: int, **kwargs) -> SimResult:
    return Simulator(workload, policy, replicas, **kwargs).run()
