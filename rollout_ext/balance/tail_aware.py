"""Tail-aware policies: longest-predicted-first placement, and re-dispatch of stragglers at chunk boundaries.

Both keep a central queue (see `CentralQueuePolicy`), ordered by predicted length; optionally
(`probe_first`, off by default: it measured worse here) one sibling per prompt goes first as a probe.

Placement (`placement="lpt"`, the default): the head of the queue goes to the free replica with
the least predicted load (KV resident + predicted remaining tokens). With true lengths this
plain LPT beat the finish-time placement below (ratio 1.110 vs 1.207 at R=128, 512x16 default
workload), so it is the default. Two admission gates were measured and are off by default
because both made R=4/R=16 worse (more waiting costs more than the preemptions they avoid):
`kv_load_factor` (predicted final KV <= factor x capacity) and `kv_resident_factor` (late
binding on an estimate of the resident KV).

KV mixing (`mix_kv_factor`, default 1.0): when the replica chosen for the head already has a
predicted load (KV resident + predicted remaining, i.e. the KV it would hold if everything
ran to its predicted end) above factor x KV capacity, the shortest queued request goes there
instead. Pure longest-first fills every batch with long sequences at the start: the KV fills,
vLLM preempts and recomputes, and the batch shrinks; at the end only short ones are left and
the slots cap the batch while the KV sits half empty. In this step model a replica's time is
base x steps + terms fixed by the work, so fewer, fuller steps win. Measured (512x16,
tail_aware with move_margin 0.05, factor 0 -> 1): default workload R=16 1.667 -> 1.638, R=128
1.152 unchanged; R=4 ICC 0.45 cap 16K 1.168 -> 1.140 with preemptions 2413 -> 1422; R=4 ICC 0.85
cap 12K 1.171 -> 1.127. It costs where the cap is far above the mean (long ones start later):
R=8 ICC 0.3 cap 32K 1.404 -> 1.466.

When mixing is on (`mix_min_icc`, `mix_max_crit`): the filler must really be short, and the long
ones it delays must have slack. So mixing is on only if the predictor's fitted ICC (how much the
prompt explains, `predictor.icc()`) is at least `mix_min_icc`, or a cap-length sequence alone
(cap x tau_1) takes at most `mix_max_crit` of the batch's predicted work time (throughput-bound:
many waves per replica). With a low ICC the "shortest predicted" request is often long, and
putting it ahead of the head delays the head twice. Measured on 512x16 (TA = tail_aware,
mixing always on -> gated): R=8 ICC 0.3 cap 24K 1.337 -> 1.311, cap 32K 1.432 -> 1.380; R=16 ICC
0.3 cap 24K 1.723 -> 1.651; R=4 ICC 0.3 cap 24K keeps mixing (1.162; without it 1.195).

Predicted finish time of a replica (used by re-dispatch, and by `placement="finish"`), from the
step model and the in-flight requests' predicted remaining tokens r_i and contexts c_i
(assuming all start now and nothing is added):

    F = base * max(max_i r_i, sum_i r_i / slots) + sum_i [per_seq * r_i + kv * (c_i r_i + r_i^2 / 2)]

The first term is the number of steps (the longest sequence, or the batch throughput limit);
the sum is each sequence's own share of the per-sequence and KV-read cost. It is additive,
so adding or removing a request is O(1). Caveat: the policy has no clock, so each r_i is as of
that request's last chunk boundary (up to one chunk stale, i.e. overstated); smaller chunks
make F fresher. Measured alternative (not kept): a replica decodes its sequences in lock step,
so releases give it a step clock and every r_i can be aged in O(1) (overdue ones re-predicted
by survival). With true lengths that removes every harmful move (tail_aware_oracle = oracle_lpt,
1.110 at R=128), but with the predictor it made tail_aware worse (1K chunks: R=16 1.716 vs
1.621, R=128 1.245 vs 1.163 with re-prediction; 1.657 / 1.180 without): the overstated, stale
remaining lengths act as a conservative bias against moving on weak evidence.

`placement="finish"` (round 1): the head of the queue goes to the free replica whose F
grows least, but only if that F stays within the predicted makespan (max F over replicas, or
total predicted work over aggregate saturated throughput, whichever is larger). So replicas
that host predicted stragglers stop taking bulk (their batch is capped by the model, not by a
fixed number), and the bulk waits for a replica that frees up. Nothing is held back when
nothing runs (no starvation).

Re-dispatch (`tail_aware`): at a chunk boundary, once no fresh work waits, a sequence moves to
the replica that minimises the pair's predicted makespan, only if the gain beats the re-prefill
of prompt + generated tokens plus a margin, and at most `max_moves_per_request` times. Its
remaining length is re-predicted there, conditioned on having survived g tokens, which is how
stragglers are identified. `critical_share` (off by default; mixed results) restricts moves to
sequences whose home replica is predicted to finish near the latest one.

A move is judged with the sequence's predicted remaining length times `move_rem_factor` (default
1.5, capped at what max_tokens leaves). The gain of a move is convex in the remaining length r:
the longest sequence sets a replica's step count (the max in F) and KV reads grow with r^2. So
the gain at the mean r understates the mean gain (Jensen). For a survivor the predictor's
sqrt(E[r^2]) / E[r] is 1.5-1.65 below 4K generated tokens and falls to 1.0 near the cap
(measured: ICC 0.3, cap 24K); the predicted means are unbiased (true / predicted mean remaining
0.96-1.07 at g = 1K..16K). Measured on 512x16 (cells where tail_aware beat round_robin and
verl_default and was not above placement-only, factor 1.0 -> 1.5): seeds 100-107 at R = 8, 16,
32, 64: 26/32 -> 31/32; fresh workloads (ICC 0.45/0.65, cap 12K/20K/28K, seeds 300-307) at R=24:
4/8 -> 8/8, R=12: 6/8 -> 7/8. On R=32 the geometric mean over round_robin was 0.963 / 0.953 /
0.952 for factors 1.25 / 1.5 / 2.0. Judging each move at the predicted sqrt(E[r^2]) instead
(per sequence) was worse (R=32: 7/8, 0.969; R=24: 7/8, 0.965 against 8/8, 0.953 / 0.958).
`move_margin` trades gain for safety. Its default 0.03 was chosen (with factor 1.0, before the
mixing gate) on the seeds 100-107 set above: 23/32 cells passed with 0.03, 20/32 with 0.04 and
16/32 with 0.05; 0.1 suppressed all moves. The risk: with true lengths, moves made R=128 worse
(1.110 -> 1.19 with factor 1.0), because F compares stale remaining lengths (see above).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from rollout_ext.balance.policy import CentralQueuePolicy
from rollout_ext.balance.step_model import StepModel


@dataclass(frozen=True, kw_only=True, slots=True)
class TailAwareConfig:
    redispatch: bool = True  # move sequences at chunk boundaries (False: placement only)
    placement: str = "lpt"  # "lpt": least predicted load; "finish": least predicted finish + hold-back
    probe_first: bool = False  # run one sibling per prompt before the rest of its group
    hold_back: bool = True  # keep bulk off replicas whose predicted finish is already the latest
    target_slack: float = 0.02  # placement may exceed the predicted makespan by this share
    max_moves_per_request: int = 1  # moves per sequence (each costs a re-prefill)
    move_margin: float = 0.03  # required predicted gain, as a share of the current finish
    move_while_queued: bool = False  # allow moves while fresh work still waits in the queue
    kv_load_factor: float = 0.0  # place only while predicted load <= this x KV capacity (0: off)
    kv_resident_factor: float = 0.0  # place only while resident KV estimate <= this x capacity (0: off)
    critical_share: float = 0.0  # (0: off) move only if staying would finish within this share of the latest replica
    mix_kv_factor: float = 1.0  # (0: off) past this x KV capacity of predicted load, place the shortest instead
    move_rem_factor: float = 1.5  # a move is judged with the predicted remaining length x this
    mix_min_icc: float = 0.5  # mix only if the predictor's ICC is at least this ...
    mix_max_crit: float = 0.25  # ... or a cap-length sequence takes at most this share of the work time

    def __post_init__(self) -> None:
        if self.placement not in ("lpt", "finish"):
            raise ValueError(f"TailAwareConfig.placement={self.placement!r}; allowed: 'lpt', 'finish'")
        rules = dict.fromkeys(("kv_load_factor", "kv_resident_factor", "critical_share", "mix_kv_factor"),
                              ">= 0 (0: off)")
        rules |= dict.fromkeys(("mix_min_icc", "mix_max_crit", "target_slack", "move_margin",
                                "max_moves_per_request"), ">= 0")
        rules["move_rem_factor"] = "> 0 (1: the mean)"
        for name, rule in rules.items():
            value = getattr(self, name)
            if value < 0 or (value == 0 and rule.startswith("> ")):
                raise ValueError(f"TailAwareConfig.{name}={value!r}; allowed: {rule}")


class _Agg:
    __slots__ = ("n", "sum_rem", "sum_w", "max_rem", "dirty", "rems")

    def __init__(self) -> None:
        self.n = 0
        self.sum_rem = 0.0
        self.sum_w = 0.0
        self.max_rem = 0.0
        self.dirty = False
        self.rems: dict[str, tuple[float, float]] = {}  # request -> (remaining, w)

    def peak(self) -> float:
        if self.dirty:
            self.max_rem = max((r for r, _ in self.rems.values()), default=0.0)
            self.dirty = False
        return self.max_rem


class TailAwarePolicy(CentralQueuePolicy):
    name = "tail_aware"

    def __init__(self, *, predictor, model: StepModel | None = None,
                 config: TailAwareConfig | None = None, slots_per_replica: int | None = None,
                 seed: int = 0) -> None:
        self.model = model or StepModel()
        super().__init__(predictor=predictor, seed=seed,
                         slots_per_replica=slots_per_replica or self.model.max_num_seqs)
        self.config = config or TailAwareConfig()
        if not self.config.redispatch:
            self.name = "tail_aware_placement"
        self._agg: dict[str, _Agg] = {}
        self._group_members: dict[str, list[str]] = {}
        self._probe: set[str] = set()
        self._moved: dict[str, int] = {}
        self._queued_pred: dict[str, float] = {}
        self._queued_tokens = 0.0
        self._prompt_tokens_sum = 0
        self._resident: dict[str, float] = {}  # replica -> prompt + generated of its in-flight requests
        self._chunk_guess = 2048.0  # tokens a request may have generated since its last boundary
        self._short: list[tuple[float, int, str]] = []  # (priority, tiebreak, request id): the short end
        self._max_tokens = 0
        self._batch_work_s = 0.0

    # ---- membership and intake ------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        super().add_replica(replica_id)
        self._agg.setdefault(replica_id, _Agg())

    def remove_replica(self, replica_id: str) -> list[str]:
        orphans = super().remove_replica(replica_id)
        self._agg.pop(replica_id, None)
        self._resident.pop(replica_id, None)
        return orphans

    def submit(self, request) -> None:
        super().submit(request)
        members = self._group_members.setdefault(request.group_key, [])
        if not members and self.config.probe_first:
            self._probe.add(request.request_id)
        members.append(request.request_id)
        self._prompt_tokens_sum += request.prompt_len
        self._max_tokens = max(self._max_tokens, request.max_tokens)

    # ---- queue ----------------------------------------------------------------------------
    def _priority(self, request_id: str) -> float:
        pred = self.generated[request_id] + self.remaining(request_id)
        self._queued_tokens += pred - self._queued_pred.get(request_id, 0.0)
        self._queued_pred[request_id] = pred
        # Probes first (their finish informs 15 siblings), then longest predicted first.
        return pred + (1e12 if request_id in self._probe else 0.0)

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
        group = self.requests[request_id].group_key
        for sibling in self._group_members.get(group, ()):
            if sibling in self._queued:
                self._requeue(sibling)

    # ---- predicted finish -----------------------------------------------------------------
    def _w(self, rem: float, ctx: float) -> float:
        m = self.model
        return m.per_seq_us * 1e-6 * rem + m.kv_s * (ctx * rem + rem * rem / 2)

    def _finish_s(self, agg: _Agg, add_rem: float = 0.0, add_w: float = 0.0, drop: str | None = None) -> float:
        sum_rem, sum_w, peak = agg.sum_rem + add_rem, agg.sum_w + add_w, agg.peak()
        if drop is not None and drop in agg.rems:
            r, w = agg.rems[drop]
            sum_rem, sum_w = sum_rem - r, sum_w - w
            if r >= peak:
                peak = max((x for k, (x, _) in agg.rems.items() if k != drop), default=0.0)
        steps = max(peak, add_rem, sum_rem / self.slots_per_replica)
        return self.model.base_ms * 1e-3 * steps + sum_w

    def _place(self, request_id: str, replica_id: str) -> None:
        super()._place(request_id, replica_id)
        req = self.requests[request_id]
        rem = self._contrib[request_id] - req.prompt_len - self.generated[request_id]
        w = self._w(rem, req.prompt_len + self.generated[request_id])
        self._resident[replica_id] = self._resident.get(replica_id, 0.0) + req.prompt_len + self.generated[request_id]
        agg = self._agg[replica_id]
        agg.rems[request_id] = (rem, w)
        agg.n += 1
        agg.sum_rem += rem
        agg.sum_w += w
        agg.max_rem = max(agg.max_rem, rem) if not agg.dirty else agg.max_rem

    def _unplace(self, request_id: str) -> None:
        replica_id = self.where[request_id]
        req = self.requests[request_id]
        self._resident[replica_id] = max(0.0, self._resident[replica_id] - req.prompt_len - self.generated[request_id])
        super()._unplace(request_id)
        agg = self._agg[replica_id]
        rem, w = agg.rems.pop(request_id)
        agg.n -= 1
        agg.sum_rem = max(0.0, agg.sum_rem - rem) if agg.rems else 0.0
        agg.sum_w = max(0.0, agg.sum_w - w) if agg.rems else 0.0
        if rem >= agg.max_rem:
            agg.dirty = True

    def _work_s(self) -> float:
        """All predicted remaining work (in flight and queued) at saturated throughput."""
        in_flight = sum(a.sum_rem for a in self._agg.values())
        n = max(1, len(self.requests))
        mean_pred = (in_flight + self._queued_tokens) / max(1, len(self.where) + len(self._queued))
        ctx = self._prompt_tokens_sum / n + 1.5 * mean_pred  # rough token-weighted context
        x_sat = self.model.saturated_tokens_per_s(ctx)
        return (in_flight + self._queued_tokens) / (max(1, len(self.replicas)) * x_sat)

    def _target_s(self) -> float:
        """Predicted makespan: the latest replica finish, or all predicted work at saturation."""
        latest = max((self._finish_s(a) for a in self._agg.values()), default=0.0)
        return max(latest, self._work_s())

    def _mixing(self) -> bool:
        """Whether KV mixing may send a short request ahead of the head (see the module doc)."""
        cfg = self.config
        if cfg.mix_kv_factor <= 0:
            return False
        if self.predictor is not None and self.predictor.icc() >= cfg.mix_min_icc:
            return True
        # The regime is set by the batch's work, not by what is left of it (late in a batch
        # every cap-length sequence is critical anyway): the largest work seen since idle.
        if not self.where:
            self._batch_work_s = 0.0
        self._batch_work_s = max(self._batch_work_s, self._work_s())
        crit_s = self._max_tokens * self.model.step_s(1, 0)
        return crit_s <= cfg.mix_max_crit * self._batch_work_s

    # ---- placement ------------------------------------------------------------------------
    def _pump(self) -> None:
        free = [rep for rep, rids in self.replicas.items() if len(rids) < self.slots_per_replica]
        if not (self._queue and free):
            return
        if self.config.placement == "lpt":
            self._pump_lpt(free)
            return
        target = self._target_s() * (1 + self.config.target_slack)
        while self._queue and free:
            _, tiebreak, rid = self._queue[0]
            if self._queued.get(rid) != tiebreak:
                self._pop_head()
                continue
            req = self.requests[rid]
            rem = self._queued_pred[rid] - self.generated[rid]
            w = self._w(rem, req.prompt_len + self.generated[rid])
            finishes = {rep: self._finish_s(self._agg[rep], rem, w) for rep in free}
            replica = min(free, key=lambda rep: (finishes[rep], self.load_tokens[rep]))
            alone_s = self._finish_s(_Agg(), rem, w) * (1 + self.config.target_slack)
            # Only bulk waits: a sequence long enough to shape the makespan starts now.
            if (self.config.hold_back and finishes[replica] > max(target, alone_s)
                    and alone_s < 0.5 * target and self.where):
                break  # every free replica would finish later than the predicted makespan
            self._pop_head()
            self._assign(rid, replica, free)
            target = max(target, finishes[replica])

    def _pump_lpt(self, free: list[str]) -> None:
        """Longest predicted first onto the free replica with the least predicted load."""
        mixing = self._mixing()
        while self._queue and free:
            _, tiebreak, rid = self._queue[0]
            if self._queued.get(rid) != tiebreak:
                self._pop_head()
                continue
            replica = min(free, key=self.load_tokens.__getitem__)
            # Predicted load after placing the head: the KV the replica would hold if its
            # sequences all ran to their predicted ends.
            load = self.load_tokens[replica] + self.requests[rid].prompt_len + self._queued_pred[rid]
            if mixing and self.replicas[replica] and load > self.config.mix_kv_factor * self.model.kv_capacity_tokens:
                short = self._pop_short()
                if short is not None:
                    self._assign(short, replica, free)
                    continue
            if self.config.kv_load_factor > 0 and self.replicas[replica]:
                # Beyond capacity vLLM preempts and recomputes, which stalls the whole batch.
                # Waiting for a release is cheaper.
                if load > self.config.kv_load_factor * self.model.kv_capacity_tokens:
                    break
            if self.config.kv_resident_factor > 0 and self.replicas[replica]:
                # Late binding: a sequence bound to a replica whose KV is full only waits in
                # that replica's local queue, while another replica may free up first.
                est = self._resident[replica] + len(self.replicas[replica]) * 0.5 * self._chunk_guess
                cap = self.config.kv_resident_factor * self.model.kv_capacity_tokens
                if est + self.requests[rid].prompt_len > cap:
                    free.remove(replica)
                    continue
            self._pop_head()
            self._assign(rid, replica, free)

    def _pop_head(self) -> None:
        _, tiebreak, rid = heapq.heappop(self._queue)
        if self._queued.get(rid) == tiebreak:
            self._dequeue(rid)

    # ---- re-dispatch ----------------------------------------------------------------------
    def _continue(self, request_id: str, home: str) -> str | None:
        cfg = self.config
        if not cfg.redispatch or self._moved.get(request_id, 0) >= cfg.max_moves_per_request:
            return home
        if self._queued and not cfg.move_while_queued:
            return home
        req = self.requests[request_id]
        ctx = req.prompt_len + self.generated[request_id]
        rem = self.remaining(request_id)
        # The gain of a move is convex in r (the longest sequence sets a replica's step count, KV
        # reads grow with r^2), so judging it at the mean r understates it.
        rem = min(float(req.max_tokens - self.generated[request_id]), cfg.move_rem_factor * rem)
        w = self._w(rem, ctx)
        stay = self._finish_s(self._agg[home], rem, w)
        if cfg.critical_share > 0:
            # A move off the critical path cannot shorten the makespan but still costs a re-prefill
            # that stalls the whole target batch.
            latest = max(self._finish_s(a) for a in self._agg.values())
            if stay < cfg.critical_share * latest:
                return home
        leave = self._finish_s(self._agg[home])
        reprefill_s = self.model.prefill_s(ctx)
        best, best_new = None, None
        for rep, rids in self.replicas.items():
            if rep == home or len(rids) >= self.slots_per_replica:
                continue
            other = self._finish_s(self._agg[rep])
            new = max(leave, self._finish_s(self._agg[rep], rem, w) + reprefill_s)
            gain = max(stay, other) - new
            if gain > cfg.move_margin * stay and (best_new is None or new < best_new):
                best, best_new = rep, new
        if best is None:
            return home
        self._moved[request_id] = self._moved.get(request_id, 0) + 1
        return best
