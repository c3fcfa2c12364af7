"""The replicas' step-time model, learned online from what a router sees at chunk boundaries.

A chunk is one acquire/release pair on one replica. The policy knows when it started and ended
(the clock it is given), the tokens it produced, and what else it had placed on that replica. The
step model predicts the chunk's time as

    elapsed_s = tokens * (base + per_seq * B + kv * K) + prefill * P + boundary

with B the replica's running batch and K its resident KV tokens (both averaged over the chunk),
and P the tokens the chunk had to prefill first: the whole context on a replica that does not hold
the sequence's KV (its first chunk, or after a move), else none (the prefix cache). `boundary` is
what a chunk costs beyond its steps: the answer's way to the caller, the generate call, the engine's
re-schedule, and the release's way back (on tiny CPU replicas several decode steps). It is not a
property of a replica's steps, so it is kept beside the step model (`boundary_s`, clamped to [0,
BOUNDARY_MAX_S]), with a prior of 0. All five are fitted together by least squares (the four step
constants on the ratio to the prior, `StepModel`), on relative residuals: each chunk weighs by 1 /
its time. On absolute times the longest chunks decide, and the longest are those that also waited (a
queue, a preemption), which pulls the KV and prefill constants far off even from a true start;
relative residuals keep every constant near the truth (CHANGELOG.md, "Step model and replica
speeds"). The prior decides until MIN_CHUNKS chunks have been seen; after that it is only a faint
ridge (a twentieth of a chunk) that keeps the fit solvable. The batch and KV features move together,
so a heavier pull towards a wrong prior would drag their poorly determined mix with it, and a free
fit could trade one constant against the other into a negative value: ratios are clamped to [1/50,
50] of the prior (of the project default where the prior is 0). The prefill constant is the least
determined: a chunk's prefill is small beside its decode time.

What it does not see: time a chunk waited in a replica's own queue (vLLM's waiting list, when the
KV is full) counts as step time, which biases the fit towards a slower replica; the weighing keeps
such chunks from dominating. A chunk's batch and KV are read once its start instant is over, since
requests placed at one instant run together (tail_aware.py, `_Instant`). Prefills of the
other sequences placed on the replica during a chunk (or at the same instant as it) are charged
to that chunk, since a prefill stalls every running sequence.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rollout_ext.balance.step_model import TIMING_FIELDS, StepModel

FIELDS = tuple(TIMING_FIELDS)
_TO_S = np.array(list(TIMING_FIELDS.values()))  # each field's unit in seconds
BOUNDARY_SCALE_S = 1e-3  # the fit's unit for the per-chunk cost
BOUNDARY_MAX_S = 60.0  # its clamp: a chunk whose fixed cost passes a minute is a stall, not a cost
PRIOR_CHUNKS = 0.05  # the prior's weight, in typical chunks: it only keeps an early fit solvable
RATIO_RANGE = (0.02, 50.0)
MIN_CHUNKS = 32  # chunks before the first fit replaces the prior
REFIT_EVERY = 8  # chunks between refits


def off_by(model: StepModel, factor: float) -> StepModel:
    """`model` with every timing constant wrong by `factor`, in alternating directions (x factor,
    / factor, ...): a prior for testing calibration. A uniform error would change no decision."""
    return replace(model, **{f: getattr(model, f) * (factor if i % 2 == 0 else 1 / factor)
                             for i, f in enumerate(FIELDS)})


class StepModelFit:
    def __init__(self, prior: StepModel) -> None:
        self.prior = prior
        prior_values = np.array([getattr(prior, f) for f in FIELDS])
        # The fit runs on ratios to a scale: the prior's constant, or the default one where the prior says 0.
        fallback = np.array([getattr(StepModel(), f) for f in FIELDS])
        self._scale = np.where(prior_values > 0, prior_values, fallback)
        # The per-chunk cost is a fifth unknown, in BOUNDARY_SCALE_S, with a prior of 0.
        self._unit = np.append(self._scale * _TO_S, BOUNDARY_SCALE_S)
        # A typical chunk sets the ridge's weight: 1K tokens at half the slots and half the KV, a
        # 2K-token prefill and one boundary, over its time under the prior (chunks weigh by 1 / time,
        # see observe).
        prior_ratio = np.append(prior_values / self._scale, 0.0)
        typical = self._unit * np.array([1024.0, 1024.0 * prior.max_num_seqs / 2,
                                         1024.0 * prior.kv_capacity_tokens / 2, 2048.0, 1.0])
        typical /= typical @ prior_ratio
        ridge = PRIOR_CHUNKS * typical * typical
        self._a = np.diag(ridge)
        self._b = ridge * prior_ratio  # pulled towards the prior
        self.chunks = 0
        self.model = prior
        self.boundary_s = 0.0  # fitted cost of a chunk beyond its steps and prefill

    def observe(self, tokens: int, elapsed_s: float, batch: float, kv_tokens: float, prefill_tokens: float) -> None:
        """One chunk: `tokens` decoded in `elapsed_s`, beside `batch` sequences holding `kv_tokens`."""
        if tokens <= 0 or elapsed_s <= 0:
            return
        # Relative residuals: each chunk weighs by 1 / its time, so a chunk that waited far longer than
        # its steps (a queue, a preemption) does not drown the many short ones that pin the constants.
        x = np.array([tokens, tokens * batch, tokens * kv_tokens, prefill_tokens, 1.0]) * self._unit / elapsed_s
        self._a += np.outer(x, x)
        self._b += x
        self.chunks += 1
        if self.chunks >= MIN_CHUNKS and self.chunks % REFIT_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        solved = np.linalg.solve(self._a, self._b)
        values = self._scale * np.clip(solved[:-1], *RATIO_RANGE)
        self.model = replace(self.prior, **{f: float(v) for f, v in zip(FIELDS, values)})
        self.boundary_s = float(np.clip(solved[-1] * BOUNDARY_SCALE_S, 0.0, BOUNDARY_MAX_S))

    def ratios(self) -> dict[str, float]:
        """Fitted constant / its scale (the prior's constant where that is > 0), per field."""
        return {f: round(getattr(self.model, f) / scale, 3) for f, scale in zip(FIELDS, self._scale)}
