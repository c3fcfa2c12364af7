"""How fast each replica steps, beside the others. The step model is one fit for all replicas, and real
replicas are not all alike: a degraded device, a throttled node, a noisy neighbour on the host.

Evidence: the intervals between two releases on one replica. Sequences on a replica decode in lock
step, so a release tells how many steps the replica has run (tail_aware.py, `ReplicaLoad.steps`); the
policy knows the batch it placed there and the prefills it sent. An interval's time over the fitted
model's time for its steps is the replica's ratio for that interval. Intervals that are mostly
prefill are left out (the prefill constant is the fit's least determined one), and so is time a
replica sat empty.

A replica's speed is its time over its model time, summed over its whole history (halved every
WINDOW_S of model time), relative to the replicas' mean: a common factor is the fit's business. The
model's error changes with the phase of a run (the batch mix, a full KV cache, work waiting in the
engine's queue) for every replica at once, so only sums over the same stretch of the run compare.

A replica counts as slower than the others by what it differs from the mean beyond DEADBAND, and
never as faster. Equal replicas do not come out equal: the fit's constants are off by a few to 25%
(the batch and KV columns are nearly collinear, calibration.py), and a replica's share of KV reads
in its steps depends on what it holds, so its ratio carries the fit's error in its own proportion.
Used both ways,
the "fast" ones draw moves that stack there and the sweep gets worse; used only to avoid slow
replicas, equal replicas are unchanged and a slow one is still found (docs/router.md, "Measured and
dropped"; the runs are in CHANGELOG.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Intervals between re-estimates of the speeds; a fleet of fewer replicas re-estimates once per round
# (one interval per replica on average): a short real run on two replicas gives a few dozen intervals.
ESTIMATE_EVERY = 16
WINDOW_S = 3600.0  # a replica's sums are halved after this much model time
DEADBAND = math.log(1.1)  # speeds within 10% of the mean count as equal


@dataclass(slots=True)
class _Evidence:
    """One replica's timed intervals: their summed time and model time (halved together), and how many
    were taken and left out."""

    elapsed_s: float = 0.0
    model_s: float = 0.0
    intervals: int = 0
    left_out: int = 0


class ReplicaSpeeds:
    def __init__(self) -> None:
        self._evidence: dict[str, _Evidence] = {}
        self._intervals = 0
        self.slowdown: dict[str, float] = {}  # replica -> its step time over the others' (>= 1)

    def add_replica(self, replica_id: str) -> None:
        self._evidence.setdefault(replica_id, _Evidence())
        self.slowdown.setdefault(replica_id, 1.0)

    def remove_replica(self, replica_id: str) -> None:
        self._evidence.pop(replica_id, None)
        self.slowdown.pop(replica_id, None)

    def observe(self, replica_id: str, elapsed_s: float, model_s: float) -> bool:
        """`replica_id` ran for `elapsed_s` what the fitted model times at `model_s`. True when the speeds
        were re-estimated (every ESTIMATE_EVERY intervals, or every len(replicas) if that is fewer)."""
        ev = self._evidence.get(replica_id)
        if ev is None or not (elapsed_s > 0 and model_s > 0):
            return False
        ev.intervals += 1
        ev.elapsed_s += elapsed_s
        ev.model_s += model_s
        if ev.model_s >= WINDOW_S:
            ev.elapsed_s /= 2
            ev.model_s /= 2
        self._intervals += 1
        if self._intervals % min(ESTIMATE_EVERY, len(self._evidence)):
            return False
        logs = {rid: math.log(e.elapsed_s / e.model_s) for rid, e in self._evidence.items() if e.intervals}
        mean = sum(logs.values()) / len(logs)
        for rid in self._evidence:
            d = logs.get(rid, mean) - mean
            self.slowdown[rid] = math.exp(max(0.0, d - DEADBAND))
        return True

    def left_out(self, replica_id: str) -> None:
        """An interval of `replica_id` that was not evidence (mostly prefill)."""
        if (ev := self._evidence.get(replica_id)) is not None:
            ev.left_out += 1

    def evidence(self) -> dict[str, dict]:
        """Per replica: its summed time and model time, and how many intervals were taken and left out."""
        return {rid: {**asdict(e), "elapsed_s": round(e.elapsed_s, 4), "model_s": round(e.model_s, 4)}
                for rid, e in self._evidence.items()}
