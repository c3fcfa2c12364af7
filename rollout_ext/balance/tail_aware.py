"""Tail-aware policies: longest-predicted-first placement, and re-dispatch of stragglers at chunk boundaries.

`tail_aware_placement` and `tail_aware` keep a central queue (`CentralQueuePolicy`), ordered by
predicted total length; `tail_aware` also moves sequences at chunk boundaries. The measurements
behind each rule, and the variants measured and dropped, are in docs/router.md ("The tail_aware
policy").

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
recorded (`_Replica`; all start now, nothing is added):

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
stacked, 189.3 s spread, 197.9 s placement only; docs/router.md). Its remaining length is
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
from rollout_ext.balance.policy import CentralQueuePolicy
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


class _Replica:
    """A replica's in-flight requests as the finish-time formula needs them (model-free sums, so a
    refitted step model applies at once).

    Sequences on a replica decode in lock step, so every release tells how many steps the replica
    has run (`steps`), and each remaining length is aged by the steps run since it was recorded, at
    its own rate `alpha`: how much its predicted remaining length fell per generated token between
    its last two boundaries (1 for a known length; near 0 for a survivor of a heavy tail, whose
    expected rest hardly shrinks as it runs). Without aging, a replica's finish is overstated by up
    to a chunk of steps for every sequence between boundaries; at a boundary that many sequences
    share, the first one judged saw its neighbours a chunk stale and moved, and the next one moved
    onto the replica it had left (docs/router.md, "Aged remaining lengths")."""

    __slots__ = ("rems", "steps", "resident", "prefilled", "instant", "movers", "_sums", "mark", "placed_steps")

    def __init__(self) -> None:
        # request -> (remaining tokens, alpha, context, replica step), as of its placement
        self.rems: dict[str, tuple[float, float, float, float]] = {}
        self.steps = 0.0  # decode steps this replica has run, as far as releases tell
        self.resident = 0.0  # prompt + generated of the in-flight requests, as of their last boundary
        self.prefilled = 0.0  # tokens sent here to prefill, ever (a prefill stalls every running sequence)
        self.instant: _Instant | None = None  # the latest clock at which requests were placed here
        self.movers = 0  # in-flight requests that moved here
        self._sums: tuple[float, float, float] | None = None  # (sum rem, sum KV token-steps, peak), aged
        self.mark: tuple[float, float, float] | None = None  # (clock, steps, prefilled) at its last release
        self.placed_steps = 0.0  # sum over the in-flight requests of `steps` at their placement

    def add(self, request_id: str, rem: float, ctx: float, alpha: float = 1.0) -> None:
        self.rems[request_id] = (rem, alpha, ctx, self.steps)
        self.resident += ctx
        self.placed_steps += self.steps
        self._sums = None

    def remove(self, request_id: str) -> None:
        _, _, ctx, step = self.rems.pop(request_id)
        # Clamp: float round-off must never leave a negative sum behind.
        self.resident = max(0.0, self.resident - ctx) if self.rems else 0.0
        self.placed_steps = self.placed_steps - step if self.rems else 0.0
        self._sums = None

    def kv_now(self) -> float:
        """Resident KV tokens now: each in-flight request's context at placement, plus a token for
        every step the replica ran since."""
        return self.resident + len(self.rems) * self.steps - self.placed_steps

    def ran(self, request_id: str, ctx: float) -> None:
        """A request placed here reports its context `ctx`: the replica ran a step for every token it
        generated since its placement."""
        _, _, ctx_placed, step = self.rems[request_id]
        steps = max(self.steps, step + ctx - ctx_placed)
        if steps != self.steps:
            self.steps, self._sums = steps, None

    def sums(self) -> tuple[float, float, float]:
        """(remaining tokens, KV token-steps, the longest remaining) of the in-flight requests, aged to
        `steps`. Recomputed only after a change: a replica is judged far more often than it changes."""
        if self._sums is None:
            total = kv = peak = 0.0
            for rem, alpha, ctx, step in self.rems.values():
                d = self.steps - step
                rem = max(0.0, rem - alpha * d)
                total += rem
                kv += _kv_token_steps(rem, ctx + d)
                peak = max(peak, rem)
            self._sums = (total, kv, peak)
        return self._sums


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
        self._inflight: dict[str, _Replica] = {}
        self._group_members: dict[str, list[str]] = {}
        self._moved: dict[str, int] = {}
        self._last_pred: dict[str, tuple[int, float]] = {}  # request -> (generated, predicted rest) at its last placement
        self._queued_pred: dict[str, float] = {}
        self._queued_tokens = 0.0
        self._prompt_tokens_sum = 0
        self._short: list[tuple[float, int, str]] = []  # (predicted length, tiebreak, request id)
        self._max_tokens = 0
        self._batch_work_s = 0.0  # the largest predicted work seen since the replicas were last idle
        # request -> its running chunk: (the instant it started at, generated tokens at its start)
        self._chunk: dict[str, tuple[_Instant, int]] = {}
        self._released_s: dict[str, float] = {}  # request -> its last unfinished release, caller's clock
        self._gap_s = 0.0  # mean release -> acquire gap at boundaries (recent GAP_WINDOW of them)
        self._gaps = 0
        self.speeds = ReplicaSpeeds()  # each replica's speed beside the others, from the clock

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
    def add_replica(self, replica_id: str) -> None:
        super().add_replica(replica_id)
        self._inflight.setdefault(replica_id, _Replica())
        self.speeds.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> list[str]:
        orphans = super().remove_replica(replica_id)
        self._inflight.pop(replica_id, None)
        self.speeds.remove_replica(replica_id)
        return orphans

    def submit(self, request) -> None:
        super().submit(request)
        self._group_members.setdefault(request.group_key, []).append(request.request_id)
        self._prompt_tokens_sum += request.prompt_len
        self._max_tokens = max(self._max_tokens, request.max_tokens)

    # ---- queue ----------------------------------------------------------------------------
    def _priority(self, request_id: str) -> float:
        pred = self.generated[request_id] + self.remaining(request_id)
        self._queued_tokens += pred - self._queued_pred.get(request_id, 0.0)
        self._queued_pred[request_id] = pred
        return pred

    def _enqueue(self, request_id: str) -> None:
        super()._enqueue(request_id)
        if self.config.mix_kv_factor > 0:
            tiebreak = self._queued[request_id]
            heapq.heappush(self._short, (self._queued_pred[request_id], tiebreak, request_id))

    def _pop_short(self) -> str | None:
        while self._short:
            _, tiebreak, rid = heapq.heappop(self._short)
            if self._queued.get(rid) == tiebreak:
                self._dequeue(rid)
                return rid
        return None

    def _dequeue(self, request_id: str) -> None:
        del self._queued[request_id]
        self._queued_tokens -= self._queued_pred.pop(request_id, 0.0)

    def _on_release(self, request_id: str, replica_id: str, finished: bool) -> None:
        if not self._queued:
            return
        # A finished or longer-lived sibling changed the group's prediction: re-key the queued ones.
        group = self.requests[request_id].group_key
        for sibling in self._group_members.get(group, ()):
            if sibling in self._queued:
                self._requeue(sibling)

    # ---- predicted finish -----------------------------------------------------------------
    def _finish_s(self, replica_id: str, add_rem: float = 0.0, add_kv: float = 0.0) -> float:
        m = self.model
        sum_rem, sum_kv, peak = self._inflight[replica_id].sums()
        steps = max(peak, add_rem, (sum_rem + add_rem) / self.slots_per_replica)
        return self.speeds.speeds[replica_id] * (m.base_ms * 1e-3 * steps + m.per_seq_us * 1e-6 * (sum_rem + add_rem)
                                                 + m.kv_s * (sum_kv + add_kv))

    def _ctx(self, request_id: str) -> float:
        return self.requests[request_id].prompt_len + self.generated[request_id]

    def _place(self, request_id: str, replica_id: str) -> None:
        ctx = self._ctx(request_id)
        # Only the replica it last ran on holds its KV (prefix cache); anywhere else it prefills it all.
        prefill = 0.0 if self.home.get(request_id) == replica_id and self.generated[request_id] > 0 else ctx
        super()._place(request_id, replica_id)
        rep = self._inflight[replica_id]
        rem = self._contrib[request_id] - ctx
        rep.add(request_id, rem, ctx, self._alpha(request_id, rem))
        self._last_pred[request_id] = (self.generated[request_id], rem)
        rep.movers += bool(self._moved.get(request_id))
        if self.clock_s is not None:
            if rep.instant is None or rep.instant.clock_s != self.clock_s:
                rep.instant = _Instant(self.clock_s, rep.prefilled)
            self._chunk[request_id] = (rep.instant, self.generated[request_id])
            self._note_instant(rep)
            if len(rep.rems) == 1:  # it was empty: its time starts counting now (_time_replica)
                rep.mark = (self.clock_s, rep.steps, rep.prefilled)
        rep.prefilled += prefill

    def _alpha(self, request_id: str, rem: float) -> float:
        """How fast this sequence's predicted rest falls per generated token, from its last two
        placements (1 before it has two: a fresh sequence is mostly short of its typical length)."""
        g = self.generated[request_id]
        last = self._last_pred.get(request_id)
        if last is None or g <= last[0]:
            return 1.0
        return min(1.0, max(0.0, (last[1] - rem) / (g - last[0])))

    def _unplace(self, request_id: str) -> None:
        replica_id = self.where[request_id]
        super()._unplace(request_id)
        rep = self._inflight[replica_id]
        rep.remove(request_id)
        rep.movers -= bool(self._moved.get(request_id))
        self._chunk.pop(request_id, None)
        self._note_instant(rep)
        if not rep.rems:
            rep.mark = None  # time it sits empty is not step time

    def _note_instant(self, rep: _Replica) -> None:
        if rep.instant is not None and rep.instant.clock_s == self.clock_s:
            rep.instant.batch, rep.instant.resident = len(rep.rems), rep.resident

    def release(self, request_id: str, replica_id: str, generated_tokens: int | None, finished: bool,
                now_s: float | None = None) -> None:
        chunk = self._chunk.get(request_id)
        placed_here = self.where.get(request_id) == replica_id
        # None: the caller does not know the length, so the chunk tells the step model nothing either.
        counted = placed_here and generated_tokens is not None
        if counted:
            self._inflight[replica_id].ran(request_id, self.requests[request_id].prompt_len + generated_tokens)
        timed = now_s is not None and counted
        if finished and placed_here:
            self._released_s.pop(request_id, None)
        elif timed:
            self._released_s[request_id] = now_s
        if timed:
            self._time_replica(replica_id, now_s)
        if chunk is not None and timed:
            start, start_tokens = chunk
            rep = self._inflight[replica_id]
            prefill = rep.prefilled - start.prefilled  # its own, and every admission during the chunk
            tokens = generated_tokens - start_tokens
            batch = (start.batch + len(self.replicas[replica_id])) / 2
            # Resident KV is known as of each request's last boundary; in between, every running
            # sequence is on average half a chunk further.
            kv = (start.resident + rep.resident) / 2 + batch * tokens / 2
            self.fit.observe(tokens, now_s - start.clock_s, *self._running(batch, kv), prefill)
        super().release(request_id, replica_id, generated_tokens, finished, now_s)
        if finished:
            self._last_pred.pop(request_id, None)

    def _time_replica(self, replica_id: str, now_s: float) -> None:
        """The replica's steps since its last release, timed: evidence of its speed (speeds.py)."""
        rep = self._inflight[replica_id]
        mark, rep.mark = rep.mark, (now_s, rep.steps, rep.prefilled)
        if mark is None:
            return
        elapsed_s, steps = now_s - mark[0], rep.steps - mark[1]
        if elapsed_s <= 0 or steps <= 0:
            return
        batch = len(self.replicas[replica_id])
        decode_s = steps * self.model.step_s(*self._running(batch, rep.kv_now() - batch * steps / 2))
        prefill_s = self.model.prefill_s(rep.prefilled - mark[2])
        if prefill_s <= SPEED_PREFILL_SHARE * decode_s:
            self.speeds.observe(replica_id, elapsed_s, decode_s + prefill_s)
        else:
            self.speeds.left_out(replica_id)

    def _running(self, batch: float, kv: float) -> tuple[float, float]:
        """The batch and KV that run of those placed on a replica: past the KV capacity, vLLM runs only
        what fits, and the rest waits in its queue."""
        running = min(1.0, self.model.kv_capacity_tokens / kv) if kv > 0 else 1.0
        return batch * running, kv * running

    def _work_s(self) -> float:
        """All predicted remaining work (in flight and queued) at saturated throughput."""
        # As recorded, not aged (load = resident + recorded remaining): a rough regime estimate, read at
        # every placement, needs no O(n) pass.
        in_flight = sum(self.load_tokens[r] - rep.resident for r, rep in self._inflight.items())
        mean_pred = (in_flight + self._queued_tokens) / max(1, len(self.where) + len(self._queued))
        ctx = self._prompt_tokens_sum / max(1, len(self.requests)) + 1.5 * mean_pred  # rough token-weighted context
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
        if not self.where:
            self._batch_work_s = 0.0
        self._batch_work_s = max(self._batch_work_s, self._work_s())

    # ---- placement ------------------------------------------------------------------------
    def _pump(self) -> None:
        free = [rep for rep, rids in self.replicas.items() if len(rids) < self.slots_per_replica]
        if not (self._queue and free):
            return
        self._note_batch_work()
        mixing = self._mixing()
        while self._queue and free:
            _, tiebreak, rid = self._queue[0]
            if self._queued.get(rid) != tiebreak:
                heapq.heappop(self._queue)
                continue
            head = self.requests[rid].prompt_len + self._queued_pred[rid]
            # Where the head's work ends first: least predicted load, in time on each replica's speed.
            replica = min(free, key=lambda r: (self.load_tokens[r] + head) * self.speeds.speeds[r])
            # Predicted load after placing the head: the KV the replica would hold if its
            # sequences all ran to their predicted ends.
            load = self.load_tokens[replica] + head
            if mixing and self.replicas[replica] and load > self.config.mix_kv_factor * self.model.kv_capacity_tokens:
                short = self._pop_short()
                if short is not None:
                    self._assign(short, replica, free)
                    continue
            heapq.heappop(self._queue)
            self._dequeue(rid)
            self._assign(rid, replica, free)

    def snapshot(self) -> dict:
        out = super().snapshot()
        out["step_model_fit"] = {"chunks": self.fit.chunks, **self.fit.ratios()}
        out["boundary_gap_ms"] = round(1e3 * self._gap_s, 3)
        out["boundary_ms"] = round(1e3 * self.boundary_s, 3)
        out["replica_speed"] = {r: round(speed, 3) for r, speed in self.speeds.speeds.items()}
        out["replica_speed_evidence"] = self.speeds.evidence()
        return out

    # ---- chunk size -----------------------------------------------------------------------
    def acquire(self, request_id: str, generated_tokens: int, now_s: float | None = None) -> str | None:
        released_s = self._released_s.pop(request_id, None)
        if released_s is not None and now_s is not None:
            # The caller's release -> acquire gap: the part of a boundary's cost the policy can see.
            self._gaps += 1
            self._gap_s += (max(0.0, now_s - released_s) - self._gap_s) / min(self._gaps, GAP_WINDOW)
        return super().acquire(request_id, generated_tokens, now_s)

    def next_chunk_tokens(self, request_id: str, chunk_tokens: int) -> int:
        """`chunk_tokens`, or more where a boundary would cost over BOUNDARY_SHARE of the chunk's decode
        time on its replica (`boundary_s` over the fitted step time); 0 once it cannot move."""
        chunk_tokens = super().next_chunk_tokens(request_id, chunk_tokens)
        home = self.where.get(request_id)
        boundary_s = self.boundary_s
        if chunk_tokens <= 0 or home is None or boundary_s <= 0:
            return chunk_tokens
        step_s = self.speeds.speeds[home] * self.model.step_s(len(self.replicas[home]),
                                                              self._inflight[home].resident)
        return max(chunk_tokens, math.ceil(boundary_s / (BOUNDARY_SHARE * step_s)))

    # ---- re-dispatch ----------------------------------------------------------------------
    def _may_move(self, request_id: str) -> bool:
        # A sequence that used its moves stays home to the end: its chunks would be pure overhead.
        return self.config.redispatch and self._moved.get(request_id, 0) < self.config.max_moves_per_request

    def _continue(self, request_id: str, home: str) -> str | None:
        if self._queued or not self._may_move(request_id):
            return home
        options = self._move_options(request_id, home)
        if not options:
            return home
        # The fewest moved sequences first, then the least new makespan (see the module doc).
        best = min(options, key=lambda rep: (self._inflight[rep].movers, options[rep]))
        self._moved[request_id] = self._moved.get(request_id, 0) + 1
        return best

    def _move_options(self, request_id: str, home: str) -> dict[str, float]:
        """Replicas a move to which gains more than `move_margin`: replica -> the pair's new makespan."""
        cfg = self.config
        req = self.requests[request_id]
        ctx = req.prompt_len + self.generated[request_id]
        rem = min(float(req.max_tokens - self.generated[request_id]), cfg.move_rem_factor * self.remaining(request_id))
        kv = _kv_token_steps(rem, ctx)
        stay = self._finish_s(home, rem, kv)
        leave = self._finish_s(home)
        reprefill_s = self.model.prefill_s(ctx)
        options = {}
        for rep, rids in self.replicas.items():
            if rep == home or len(rids) >= self.slots_per_replica:
                continue
            new = max(leave, self._finish_s(rep, rem, kv) + self.speeds.speeds[rep] * reprefill_s)
            if max(stay, self._finish_s(rep)) - new > cfg.move_margin * stay:
                options[rep] = new
        return options
