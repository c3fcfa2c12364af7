"""Tail-aware policies: longest-predicted-first placement, and re-dispatch of stragglers at chunk boundaries.

`tail_aware_placement` and `tail_aware` keep a central queue (`CentralQueuePolicy`), ordered by
predicted total length; `tail_aware` also moves sequences at chunk boundaries. The rules are
described in docs/router.md ("What the policy decides"), with the variants measured and dropped; the
measurements behind them are in CHANGELOG.md.

Placement. The head of the queue goes to the free replica with the least predicted load (KV
resident + predicted remaining tokens).

KV mixing. If that replica's predicted load would pass `mix_kv_factor` x KV capacity, the shortest
queued request goes there instead. Pure longest-first fills every batch with long sequences at the
start, so the KV fills, vLLM preempts, and at the end only short ones are left to fill the slots.
Mixing is on only when the filler is really short and the long ones it delays have slack: the
predictor's fitted ICC (how much the prompt explains) is at least `mix_min_icc`, or a cap-length
sequence alone takes at most `mix_max_crit` of the batch's predicted work time.

Step model. The constants given (`model`) are a prior: with a clock (`now_s` on acquire and
release), every chunk's time refines them (rollout_ext/balance/calibration.py), and the policy
plans with the fitted model (`policy.model`).

Replica speeds. The fitted step model is one for all replicas; real replicas are not all alike. Each
replica's steps between its releases, timed on the clock, tell whether it runs slower than the
others, and by how much (rollout_ext/balance/speeds.py). Its predicted finish, and the time a
re-prefill costs there, are scaled by that speed, and the head of the queue goes to the free replica
where its work ends first in time, not in tokens.

Predicted finish time of a replica, from the step model and the in-flight requests' predicted
remaining tokens r_i and contexts c_i, both aged to the steps the replica has run since each was
recorded (`ReplicaLoad`; all start now, nothing is added):

    F = base * max(max_i r_i, sum_i r_i / slots) + sum_i [per_seq * r_i + kv * (c_i r_i + r_i^2 / 2)]

The first term is the number of steps (the longest sequence, or the batch throughput limit); the
sum is each sequence's own share of the per-sequence and KV-read cost. It is additive, so adding or
removing a request is O(1).

Chunk size. A boundary costs the sequence a round trip through the caller and a re-schedule on the
engine; it buys only the option to move. `next_chunk_tokens` answers 0 (the rest in one piece) once
a sequence has used its moves, and otherwise stretches the caller's chunk until the release ->
acquire gap the policy measures on its clock, plus the per-chunk cost the step-model fit finds
(the rest of the round trip and the engine's re-schedule), is at most BOUNDARY_SHARE of the chunk's
predicted decode time on its replica. Without a clock, or where a boundary costs nothing (the
simulator without a round trip), the chunk stays as given.

Re-dispatch. At a chunk boundary, once no fresh work waits, a sequence moves to the replica that
minimises the pair's predicted makespan, if the gain beats its re-prefill (prompt + generated) by
`move_margin` of the current finish, at most `max_moves_per_request` times. Of the destinations
that qualify, the one holding the fewest moved sequences wins, then the least new makespan: moves
are judged on predicted remaining lengths that the longest survivors outlive, so survivors stacked
on one replica slow each other down there (kv_heavy, R=128, 256x16 prompts, ICC 0.85: 208.5 s
stacked, 189.3 s spread, 197.9 s placement only; CHANGELOG.md). Its remaining length is
re-predicted conditioned on having survived g tokens, which is how stragglers are identified. The
move is judged at `move_rem_factor` x the predicted remaining length, capped by max_tokens: the gain
is convex in r (the longest sequence sets the step count, KV reads grow with r^2), so judging at the
mean understates it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from rollout_ext.balance.calibration import StepModelFit
from rollout_ext.balance.policy import CentralQueuePolicy, Replica, Seq, compact_heap
from rollout_ext.balance.speeds import ReplicaSpeeds
from rollout_ext.balance.step_model import StepModel


# A chunk boundary may cost at most this share of its chunk's decode time: chunks are stretched
# until it holds. A boundary only buys the option to move, so its cost must stay in the noise.
BOUNDARY_SHARE = 0.02
GAP_WINDOW = 64  # boundaries the measured gap averages over
# An interval counts towards its replica's speed (rollout_ext/balance/speeds.py) only if its prefills
# are at most this share of its decode time: the prefill constant is the fit's least determined one.
SPEED_PREFILL_SHARE = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class TailAwareConfig:
    redispatch: bool = True  # move sequences at chunk boundaries (False: placement only)
    max_moves_per_request: int = 2  # moves per sequence (each costs a re-prefill)
    move_margin: float = 0.03  # required predicted gain, as a share of the current finish
    move_rem_factor: float = 1.5  # a move is judged with the predicted remaining length x this
    mix_kv_factor: float = 1.0  # past this x KV capacity of predicted load, place the shortest instead (0: off)
    mix_min_icc: float = 0.5  # mix only if the predictor's ICC is at least this ...
    mix_max_crit: float = 0.25  # ... or a cap-length sequence takes at most this share of the work time

    def __post_init__(self) -> None:
        rules = dict.fromkeys(("mix_kv_factor", "mix_min_icc", "mix_max_crit", "move_margin",
                               "max_moves_per_request"), ">= 0")
        rules["move_rem_factor"] = "> 0 (1: the mean)"
        for name, rule in rules.items():
            value = getattr(self, name)
            if value < 0 or (value == 0 and rule.startswith("> ")):
                raise ValueError(f"TailAwareConfig.{name}={value!r}; allowed: {rule}")


def _kv_token_steps(rem: float, ctx: float) -> float:
    """KV tokens a sequence reads over its remaining `rem` steps from context `ctx`."""
    return ctx * rem + rem * rem / 2


@dataclass(slots=True)
class _Instant:
    """A replica at one clock reading. Requests placed at one instant start their chunks together:
    every one of them runs beside all the others and waits for all their prefills, not only for
    those placed after it, so a chunk's start is read once the instant is over."""

    clock_s: float
    prefilled: float  # tokens sent here to prefill before this instant
    batch: int = 0  # in-flight requests, as of the instant's last placement or release
    resident: float = 0.0  # their resident KV tokens, likewise


@dataclass(slots=True, eq=False)
class ReplicaLoad(Replica):
    """A replica with what the finish-time formula needs of its in-flight requests (model-free sums, so
    a refitted step model applies at once).

    Sequences on a replica decode in lock step, so every release tells how many steps the replica
    has run (`steps`), and each remaining length is aged by the steps run since it was recorded, at
    its own rate `alpha`: how much its predicted remaining length fell per generated token between
    its last two boundaries (1 for a known length; near 0 for a survivor of a heavy tail, whose
    expected rest hardly shrinks as it runs). Without aging, a replica's finish is overstated by up
    to a chunk of steps for every sequence between boundaries; at a boundary that many sequences
    share, the first one judged saw its neighbours a chunk stale and moved, and the next one moved
    onto the replica it had left (CHANGELOG.md, 8face61)."""

    steps: float = 0.0  # decode steps this replica has run, as far as releases tell
    resident: float = 0.0  # prompt + generated of the in-flight requests, as of their last boundary
    prefilled: float = 0.0  # tokens sent here to prefill, ever (a prefill stalls every running sequence)
    instant: _Instant | None = None  # the latest clock at which requests were placed here
    movers: int = 0  # in-flight requests that moved here
    # (clock, steps, prefilled) at its last release: the start of its next timed interval (speeds.py)
    mark: tuple[float, float, float] | None = None
    placed_steps: float = 0.0  # sum over the in-flight requests of `steps` at their placement
    sums_cache: tuple[float, float, float] | None = None  # `sums()` until the next change

    def add(self, seq: Seq, rem: float, ctx: float, alpha: float = 1.0) -> None:
        """`seq`, already among `running`, was placed with `rem` tokens predicted to go from context `ctx`."""
        seq.placed_rem_tokens, seq.alpha, seq.placed_ctx_tokens, seq.placed_step = rem, alpha, ctx, self.steps
        self.resident += ctx
        self.placed_steps += self.steps
        self.sums_cache = None

    def remove(self, seq: Seq) -> None:
        """`seq`, already gone from `running`, left."""
        # Clamp: float round-off must never leave a negative sum behind.
        self.resident = max(0.0, self.resident - seq.placed_ctx_tokens) if self.running else 0.0
        self.placed_steps = self.placed_steps - seq.placed_step if self.running else 0.0
        self.sums_cache = None

    def kv_now(self) -> float:
        """Resident KV tokens now: each in-flight request's context at placement, plus a token for
        every step the replica ran since."""
        return self.resident + self.batch * self.steps - self.placed_steps

    def ran(self, seq: Seq, ctx: float) -> None:
        """A request placed here reports its context `ctx`: the replica ran a step for every token it
        generated since its placement."""
        steps = max(self.steps, seq.placed_step + ctx - seq.placed_ctx_tokens)
        if steps != self.steps:
            self.steps, self.sums_cache = steps, None

    def sums(self) -> tuple[float, float, float]:
        """(remaining tokens, KV token-steps, the longest remaining) of the in-flight requests, aged to
        `steps`. Recomputed only after a change: a replica is judged far more often than it changes."""
        if self.sums_cache is None:
            total = kv = peak = 0.0
            for seq in self.running.values():
                d = self.steps - seq.placed_step
                rem = max(0.0, seq.placed_rem_tokens - seq.alpha * d)
                total += rem
                kv += _kv_token_steps(rem, seq.placed_ctx_tokens + d)
                peak = max(peak, rem)
            self.sums_cache = (total, kv, peak)
        return self.sums_cache


class TailAwarePolicy(CentralQueuePolicy):
    name = "tail_aware"

    def __init__(self, *, predictor, model: StepModel | None = None,
                 config: TailAwareConfig | None = None, slots_per_replica: int | None = None,
                 seed: int = 0) -> None:
        self.fit = StepModelFit(model or StepModel())
        super().__init__(predictor=predictor, seed=seed,
                         slots_per_replica=slots_per_replica or self.model.max_num_seqs)
        self.config = config or TailAwareConfig()
        if not self.config.redispatch:
            self.name = "tail_aware_placement"
        self.groups: dict[str, dict[str, Seq]] = {}  # group -> its live requests
        self._submitted = 0  # requests submitted, ever
        self._prompt_tokens_sum = 0  # their prompt tokens
        self._short: list[tuple[float, int, Seq]] = []  # (predicted length, tiebreak, request): lazy deletion
        self._max_tokens = 0
        self._batch_work_s = 0.0  # the largest predicted work seen since the replicas were last idle
        self._gap_s = 0.0  # mean release -> acquire gap at boundaries (recent GAP_WINDOW of them)
        self._gaps = 0
        self.speeds = ReplicaSpeeds()  # each replica's slowdown beside the others, from the clock

    @property
    def boundary_s(self) -> float:
        """What a chunk boundary costs on its clock: the release -> acquire gap the policy sees, plus the
        rest of the round trip and the engine's re-schedule, which the step-model fit measures."""
        return self._gap_s + self.fit.boundary_s

    @property
    def model(self) -> StepModel:
        """The step model the policy plans with: the prior, refined by every timed chunk."""
        return self.fit.model

    # ---- membership and intake ------------------------------------------------------------
    def _new_replica(self, replica_id: str) -> ReplicaLoad:
        return ReplicaLoad(replica_id)

    def add_replica(self, replica_id: str) -> None:
        super().add_replica(replica_id)
        self.speeds.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> list[str]:
        orphans = super().remove_replica(replica_id)
        self.speeds.remove_replica(replica_id)
        return orphans

    def submit(self, request, home: str | None = None) -> Seq:
        seq = super().submit(request, home)
        self.groups.setdefault(request.group_key, {})[request.request_id] = seq
        self._submitted += 1
        self._prompt_tokens_sum += request.prompt_len
        self._max_tokens = max(self._max_tokens, request.max_tokens)
        return seq

    # ---- queue ----------------------------------------------------------------------------
    def _enqueue(self, seq: Seq) -> None:
        super()._enqueue(seq)
        if self.config.mix_kv_factor > 0:
            heapq.heappush(self._short, (seq.queued_tokens, seq.queue_tiebreak, seq))
            self._short = compact_heap(self._short, self._waiting)

    def _drop_stale(self) -> None:
        super()._drop_stale()
        self._short.clear()

    def _pop_short(self) -> Seq | None:
        while self._short:
            _, tiebreak, seq = heapq.heappop(self._short)
            if seq.queue_tiebreak == tiebreak:
                self._dequeue(seq)
                return seq
        return None

    def _on_release(self, seq: Seq, replica_id: str, finished: bool) -> None:
        group = self.groups.get(seq.request.group_key)
        if finished and group is not None:
            group.pop(seq.request_id, None)
            if not group:
                del self.groups[seq.request.group_key]
        if not self._waiting or group is None:
            return
        # A finished or longer-lived sibling changed the group's prediction: re-key the queued ones.
        for sibling in list(group.values()):
            self._requeue(sibling)

    # ---- predicted finish -----------------------------------------------------------------
    def _finish_s(self, replica_id: str, add_rem: float = 0.0, add_kv: float = 0.0) -> float:
        return self._finish_of(self.replicas[replica_id].sums(), self.speeds.slowdown[replica_id], add_rem, add_kv)

    def _finish_of(self, sums: tuple[float, float, float], slowdown: float, add_rem: float = 0.0,
                   add_kv: float = 0.0) -> float:
        m = self.model
        sum_rem, sum_kv, peak = sums
        steps = max(peak, add_rem, (sum_rem + add_rem) / self.slots_per_replica)
        return slowdown * (m.base_ms * 1e-3 * steps + m.per_seq_us * 1e-6 * (sum_rem + add_rem) + m.kv_s * (sum_kv + add_kv))

    def _place(self, seq: Seq, replica_id: str) -> None:
        ctx = seq.request.prompt_len + seq.generated
        # Only the replica it last ran on holds its KV (prefix cache); anywhere else it prefills it all.
        prefill = 0.0 if seq.home == replica_id and seq.generated > 0 else ctx
        super()._place(seq, replica_id)
        rep = self.replicas[replica_id]
        rem = seq.load_tokens - ctx
        rep.add(seq, rem, ctx, self._alpha(seq, rem))
        seq.last_placed_generated = seq.generated
        rep.movers += bool(seq.moves)
        if self.clock_s is not None:
            if rep.instant is None or rep.instant.clock_s != self.clock_s:
                rep.instant = _Instant(self.clock_s, rep.prefilled)
            seq.chunk_start, seq.chunk_start_generated = rep.instant, seq.generated
            self._note_instant(rep)
            if rep.batch == 1:  # it was empty: its time starts counting now (_time_replica)
                rep.mark = (self.clock_s, rep.steps, rep.prefilled)
        rep.prefilled += prefill

    def _alpha(self, seq: Seq, rem: float) -> float:
        """How fast this sequence's predicted rest falls per generated token, from its last two
        placements (1 before it has two: a fresh sequence is mostly short of its typical length)."""
        g, last_g = seq.generated, seq.last_placed_generated
        if last_g is None or g <= last_g:
            return 1.0
        return min(1.0, max(0.0, (seq.placed_rem_tokens - rem) / (g - last_g)))

    def _unplace(self, seq: Seq) -> None:
        rep = self.replicas[seq.replica]
        super()._unplace(seq)
        rep.remove(seq)
        rep.movers -= bool(seq.moves)
        seq.chunk_start = None
        self._note_instant(rep)
        if not rep.running:
            rep.mark = None  # time it sits empty is not step time

    def _note_instant(self, rep: ReplicaLoad) -> None:
        if rep.instant is not None and rep.instant.clock_s == self.clock_s:
            rep.instant.batch, rep.instant.resident = rep.batch, rep.resident

    def release(self, request_id: str, replica_id: str, generated_tokens: int | None, finished: bool,
                now_s: float | None = None) -> None:
        seq = self.seqs.get(request_id)
        placed_here = seq is not None and seq.replica == replica_id
        # None: the caller does not know the length, so the chunk tells the step model nothing either.
        counted = placed_here and generated_tokens is not None
        rep = self.replicas.get(replica_id)
        if counted:
            rep.ran(seq, seq.request.prompt_len + generated_tokens)
        timed = now_s is not None and counted
        if timed and not finished:
            seq.released_s = now_s
        if timed:
            self._time_replica(rep, now_s)
        if timed and seq.chunk_start is not None:
            start = seq.chunk_start
            prefill = rep.prefilled - start.prefilled  # its own, and every admission during the chunk
            tokens = generated_tokens - seq.chunk_start_generated
            batch = (start.batch + rep.batch) / 2
            # Resident KV is known as of each request's last boundary; in between, every running
            # sequence is on average half a chunk further.
            kv = (start.resident + rep.resident) / 2 + batch * tokens / 2
            self.fit.observe(tokens, now_s - start.clock_s, *self._running(batch, kv), prefill)
        super().release(request_id, replica_id, generated_tokens, finished, now_s)

    def _time_replica(self, rep: ReplicaLoad, now_s: float) -> None:
        """The replica's steps since its last release, timed: evidence of its slowdown (speeds.py)."""
        mark, rep.mark = rep.mark, (now_s, rep.steps, rep.prefilled)
        if mark is None:
            return
        elapsed_s, steps = now_s - mark[0], rep.steps - mark[1]
        if elapsed_s <= 0 or steps <= 0:
            return
        batch = rep.batch
        decode_s = steps * self.model.step_s(*self._running(batch, rep.kv_now() - batch * steps / 2))
        prefill_s = self.model.prefill_s(rep.prefilled - mark[2])
        if prefill_s <= SPEED_PREFILL_SHARE * decode_s:
            self.speeds.observe(rep.replica_id, elapsed_s, decode_s + prefill_s)
        else:
            self.speeds.left_out(rep.replica_id)

    def _running(self, batch: float, kv: float) -> tuple[float, float]:
        """The batch and KV that run of those placed on a replica: past the KV capacity, vLLM runs only
        what fits, and the rest waits in its queue."""
        running = min(1.0, self.model.kv_capacity_tokens / kv) if kv > 0 else 1.0
        return batch * running, kv * running

    def _work_s(self) -> float:
        """All predicted remaining work (in flight and queued) at saturated throughput."""
        # As recorded, not aged (load = resident + recorded remaining): a rough regime estimate, read at
        # every placement, needs no O(n) pass.
        in_flight = sum(rep.load_tokens - rep.resident for rep in self.replicas.values())
        mean_pred = (in_flight + self._queued_tokens) / max(1, self.in_flight + self._waiting)
        ctx = self._prompt_tokens_sum / max(1, self._submitted) + 1.5 * mean_pred  # rough token-weighted context
        x_sat = self.model.saturated_tokens_per_s(ctx)
        return (in_flight + self._queued_tokens) / (max(1, len(self.replicas)) * x_sat)

    def _mixing(self) -> bool:
        """Whether KV mixing may send a short request ahead of the head (see the module doc)."""
        cfg = self.config
        if cfg.mix_kv_factor <= 0:
            return False
        if self.predictor is not None and self.predictor.icc() >= cfg.mix_min_icc:
            return True
        crit_s = self._max_tokens * self.model.step_s(1, 0)
        return crit_s <= cfg.mix_max_crit * self._batch_work_s

    def _note_batch_work(self) -> None:
        # The regime is set by the batch's work, not by what is left of it (late in a batch every
        # cap-length sequence is critical anyway): the largest work seen since the replicas were idle.
        if not self.in_flight:
            self._batch_work_s = 0.0
        self._batch_work_s = max(self._batch_work_s, self._work_s())

    # ---- placement ------------------------------------------------------------------------
    def _pump(self) -> None:
        if not self._queue:
            return
        free = self._free()
        if not free:
            return
        self._note_batch_work()
        mixing = self._mixing()
        slowdown = self.speeds.slowdown
        while self._queue and free:
            _, tiebreak, seq = self._queue[0]
            if seq.queue_tiebreak != tiebreak:
                heapq.heappop(self._queue)
                continue
            head = seq.request.prompt_len + seq.queued_tokens
            # Where the head's work ends first: least predicted load, in time on each replica's slowdown.
            rep = min(free, key=lambda r: (r.load_tokens + head) * slowdown[r.replica_id])
            # Predicted load after placing the head: the KV the replica would hold if its
            # sequences all ran to their predicted ends.
            load = rep.load_tokens + head
            if mixing and rep.running and load > self.config.mix_kv_factor * self.model.kv_capacity_tokens:
                short = self._pop_short()
                if short is not None:
                    self._assign(short, rep, free)
                    continue
            heapq.heappop(self._queue)
            self._dequeue(seq)
            self._assign(seq, rep, free)

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["step_model_fit"] = {"chunks": self.fit.chunks, **self.fit.ratios()}
        out["boundary_gap_ms"] = round(1e3 * self._gap_s, 3)
        out["boundary_ms"] = round(1e3 * self.boundary_s, 3)
        out["replica_slowdown"] = {r: round(x, 3) for r, x in self.speeds.slowdown.items()}
        out["replica_speed_evidence"] = self.speeds.evidence()
        return out

    # ---- chunk size -----------------------------------------------------------------------
    def acquire(self, request_id: str, generated_tokens: int, now_s: float | None = None) -> str | None:
        seq = self.seqs.get(request_id)
        released_s = None if seq is None else seq.released_s
        if released_s is not None:
            seq.released_s = None
            if now_s is not None:
                # The caller's release -> acquire gap: the part of a boundary's cost the policy can see.
                self._gaps += 1
                self._gap_s += (max(0.0, now_s - released_s) - self._gap_s) / min(self._gaps, GAP_WINDOW)
        return super().acquire(request_id, generated_tokens, now_s)

    def next_chunk_tokens(self, request_id: str, chunk_tokens: int) -> int:
        """`chunk_tokens`, or more where a boundary would cost over BOUNDARY_SHARE of the chunk's decode
        time on its replica (`boundary_s` over the fitted step time); 0 once it cannot move."""
        chunk_tokens = super().next_chunk_tokens(request_id, chunk_tokens)
        seq = self.seqs.get(request_id)
        home = None if seq is None else seq.replica
        boundary_s = self.boundary_s
        if chunk_tokens <= 0 or home is None or boundary_s <= 0:
            return chunk_tokens
        rep = self.replicas[home]
        step_s = self.speeds.slowdown[home] * self.model.step_s(rep.batch, rep.resident)
        return max(chunk_tokens, math.ceil(boundary_s / (BOUNDARY_SHARE * step_s)))

    # ---- re-dispatch ----------------------------------------------------------------------
    def _may_move(self, seq: Seq) -> bool:
        # A sequence that used its moves stays home to the end: its chunks would be pure overhead.
        return self.config.redispatch and seq.moves < self.config.max_moves_per_request

    def _continue(self, seq: Seq, home: str) -> str | None:
        # A later turn of a conversation starts where its prefix is cached, as verl's router keeps it:
        # nothing of this turn is measured yet. Its chunk boundaries may move it like any sequence.
        if seq.generated == 0 or self._waiting or not self._may_move(seq):
            return home
        options = self._move_options(seq, home)
        if not options:
            return home
        # The fewest moved sequences first, then the least new makespan (see the module doc).
        best = min(options, key=lambda rid: (self.replicas[rid].movers, options[rid]))
        seq.moves += 1
        return best

    def _move_options(self, seq: Seq, home: str) -> dict[str, float]:
        """Replicas a move to which gains more than `move_margin`: replica -> the pair's new makespan."""
        cfg = self.config
        req = seq.request
        ctx = req.prompt_len + seq.generated
        rem = min(float(req.max_tokens - seq.generated), cfg.move_rem_factor * self.remaining(seq))
        kv = _kv_token_steps(rem, ctx)
        stay = self._finish_s(home, rem, kv)
        leave = self._finish_s(home)
        reprefill_s = self.model.prefill_s(ctx)
        options = {}
        slowdown = self.speeds.slowdown
        for rid, rep in self.replicas.items():
            if rid == home or len(rep.running) >= self.slots_per_replica:
                continue
            sums = rep.sums()
            # Adding work never lowers a finish, so a replica that already ends at or after `stay` never
            # gains: skipping it changes no answer, and most replicas of a large fleet are skipped.
            idle = self._finish_of(sums, slowdown[rid])
            if idle >= stay:
                continue
            new = max(leave, self._finish_of(sums, slowdown[rid], rem, kv) + slowdown[rid] * reprefill_s)
            if stay - new > cfg.move_margin * stay:
                options[rid] = new
        return options
