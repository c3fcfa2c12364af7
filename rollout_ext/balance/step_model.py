"""Decode step-time model of one replica, and the makespan lower bound T* built on it.

Step time of a replica decoding a batch of B sequences holding K KV tokens:

    step_s(B, K) = base_ms + K * kv_read_ns_per_token + B * per_seq_us

Decode is memory-bound: every step reads all weights once (plus TP all-reduces and launch
overhead, folded into `base_ms`) and reads every resident KV token once. The per-sequence term
covers sampling, detokenisation and scheduler bookkeeping.

Where the default numbers come from (a Qwen2.5-32B-class model, TP8, H100-SXM-class node; this
is an estimate from spec sheets plus one measured anchor, not a fit to one trace):
- `base_ms = 8.0`: the anchor. Low-batch inter-token latency of 32B-class models at TP8 in
  vLLM is about 8 ms (the value used by the project's earlier simulation, DESIGN.md
  "Tail balancing"). Pure weight read is only ~2.4 ms (64 GB / 8 GPUs / 3.35 TB/s); the rest
  is 128 all-reduces per step and kernel launches.
- `kv_read_ns_per_token = 12`: Qwen2.5-32B has 64 layers x 8 KV heads x 128 dims x 2 (K,V) x
  2 bytes = 256 KiB per token, 32 KiB per GPU at TP8; at ~2.7 TB/s effective HBM bandwidth
  that is 12 ns per resident token.
- `per_seq_us = 27`: chosen so that a saturated replica (256 sequences, ~1M KV tokens) steps
  in ~27 ms, matching the 25-29 ms a step observed for long sequences beside bulk work.
- `prefill_us_per_token = 20`: compute-bound prefill, 2 x 32e9 FLOP per token over 8 GPUs at
  ~400 TFLOP/s effective; a 16K-token re-prefill costs ~0.33 s (DESIGN.md: "about 0.3 s").
- `max_num_seqs = 256` (vLLM default) and `kv_capacity_tokens = 1_000_000`: ~32 GB of KV
  per GPU (80 GB x 0.9 utilisation minus 8 GB weights and activations, halved for headroom).

Lower bound (DESIGN.md ground rules): for lengths L_i on R replicas,

    T* = max over k of [ k * tau_1 + (sum_i (L_i - k)^+ / X_sat + prefill work) / R ]

tau_1 is the per-token time of a lone sequence (base + one sequence, no KV: a true lower
bound). X_sat is a replica's saturated decode throughput, built from the token-weighted mean
context (the context each decoded token actually sees), because KV capacity caps the batch.
The prefill of every sequence with L_i >= k is added to the shared term: it must happen
before that sequence's first L_i - k tokens, which all precede the last k steps of the
sequence that gets there last.

Second bound, T*_dl (`lower_bound_dl_s`): T* spreads the base cost as if every step ran at
saturation. A long sequence cannot run at saturation all its life: its steps must fit in the
makespan T, so the KV they read is limited. Charge each step's base to the sequences in it in
proportion to their KV (sequence i at step s pays base x c_i(s) / K_s, c its context, K the
step's resident KV); the shares of one step sum to one base. Every step of i fits in T:

    sum_s (base + per_seq + kv K_s) <= T - prefill(p_i)  =>  sum_s K_s <= V_i(T)

By Cauchy-Schwarz, sum_s c_i(s) / K_s >= S_i^2 / V_i(T), with S_i = sum_j sqrt(p_i + j); and
K_s <= KV capacity gives sum_s c_i(s) / K_s >= W_i / KV_cap, with W_i = sum_j (p_i + j). Counting
each step's base once per sequence slot instead (1 / B_s, B_s <= max_num_seqs) gives a second
step count, sum_i L_i / max_num_seqs. All replicas together then need

    R T >= base max(sum_i max(W_i / KV_cap, S_i^2 / V_i(T)), sum_i L_i / max_num_seqs)
           + kv W + per_seq sum_i L_i + prefill(sum_i p_i)

T*_dl is the smallest T, at or above every sequence's lone critical path, that satisfies this
(the right side falls as T grows, so bisection finds it). S_i uses the integral lower bound of
the sum of square roots, which keeps the bound a bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class StepModel:
    base_ms: float = 8.0  # weight read + collectives + launch overhead of one decode step
    kv_read_ns_per_token: float = 12.0  # time to read one resident KV token per step
    per_seq_us: float = 27.0  # per running sequence per step (sampling, scheduling)
    prefill_us_per_token: float = 20.0  # compute-bound prefill / re-prefill cost per token
    max_num_seqs: int = 256  # vLLM max_num_seqs: running batch cap per replica
    kv_capacity_tokens: int = 1_000_000  # KV cache size per replica, in tokens
    # Tail drafting (patches/tail_drafting.py): while at most `draft_tail_seqs` sequences run, a
    # pass verifies `draft_tokens` drafts per sequence and yields `tokens_per_pass` tokens each.
    draft_tail_seqs: int = 0  # 0: no drafting
    draft_tokens: int = 8
    tokens_per_pass: float = 1.0

    def __post_init__(self) -> None:
        for name in ("base_ms", "kv_read_ns_per_token", "per_seq_us", "prefill_us_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.base_ms <= 0:
            raise ValueError(f"StepModel.base_ms must be > 0, got {self.base_ms}")
        if self.max_num_seqs < 1 or self.kv_capacity_tokens < 1:
            raise ValueError("StepModel.max_num_seqs and kv_capacity_tokens must be >= 1")
        if self.draft_tail_seqs < 0 or self.draft_tokens < 0 or not 1.0 <= self.tokens_per_pass <= self.draft_tokens + 1:
            raise ValueError(f"StepModel drafting: draft_tail_seqs {self.draft_tail_seqs} and draft_tokens "
                             f"{self.draft_tokens} must be >= 0, tokens_per_pass {self.tokens_per_pass} in "
                             f"[1, draft_tokens + 1]")

    @property
    def kv_s(self) -> float:
        return self.kv_read_ns_per_token * 1e-9

    def fixed_s(self, num_seqs: int) -> float:
        """Step time that does not depend on KV size."""
        return self.base_ms * 1e-3 + num_seqs * self.per_seq_us * 1e-6

    def drafting(self, num_seqs: int) -> tuple[float, float]:
        """(passes per token, verification seconds per pass) for a batch of `num_seqs`: drafting
        runs only in the tail, where a pass also computes the drafts like prefill tokens."""
        if 0 < num_seqs <= self.draft_tail_seqs:
            return 1.0 / self.tokens_per_pass, self.prefill_s(num_seqs * self.draft_tokens)
        return 1.0, 0.0

    def step_s(self, num_seqs: int, kv_tokens: float) -> float:
        """Time for each of `num_seqs` sequences to gain one token (one pass without drafting)."""
        per_token, verify_s = self.drafting(num_seqs)
        return (self.fixed_s(num_seqs) + kv_tokens * self.kv_s + verify_s) * per_token

    def steps_s(self, num_seqs: int, kv_tokens: float, num_steps: int) -> float:
        """Time of `num_steps` token steps with a fixed batch; KV grows by num_seqs each step,
        so the KV term is an arithmetic series."""
        n = num_steps
        per_token, _ = self.drafting(num_seqs)
        return n * self.step_s(num_seqs, kv_tokens) + self.kv_s * per_token * num_seqs * n * (n - 1) / 2

    def steps_within_s(self, num_seqs: int, kv_tokens: float, elapsed_s: float) -> int:
        """Largest n with steps_s(num_seqs, kv_tokens, n) <= elapsed_s (inverse of the series)."""
        if elapsed_s <= 0:
            return 0
        a = self.step_s(num_seqs, kv_tokens)
        c = self.kv_s * self.drafting(num_seqs)[0] * num_seqs / 2
        if c <= 0:
            n = int(elapsed_s / a)
        else:
            # c n^2 + (a - c) n - elapsed = 0
            b = a - c
            n = int((-b + math.sqrt(b * b + 4 * c * elapsed_s)) / (2 * c))
        while n > 0 and self.steps_s(num_seqs, kv_tokens, n) > elapsed_s:
            n -= 1
        while self.steps_s(num_seqs, kv_tokens, n + 1) <= elapsed_s:
            n += 1
        return n

    def prefill_s(self, tokens: float) -> float:
        return tokens * self.prefill_us_per_token * 1e-6

    @property
    def lone_token_s(self) -> float:
        """tau_1: per-token time of a sequence decoding alone, KV read excluded (a floor)."""
        return self.step_s(1, 0)

    def saturated_tokens_per_s(self, mean_context_tokens: float) -> float:
        """X_sat: a replica's decode throughput with the batch as large as slots and KV allow (or
        the largest drafting batch, where drafting makes that faster)."""
        ctx = max(1.0, mean_context_tokens)
        batch = max(1, min(self.max_num_seqs, int(self.kv_capacity_tokens // ctx)))
        best = batch / self.step_s(batch, batch * ctx)
        tail = min(batch, self.draft_tail_seqs)
        return max(best, tail / self.step_s(tail, tail * ctx)) if tail else best


# The timing constants, each with its unit in seconds; the rest of a StepModel is capacity.
TIMING_FIELDS = {"base_ms": 1e-3, "per_seq_us": 1e-6, "kv_read_ns_per_token": 1e-9, "prefill_us_per_token": 1e-6}


def scaled(model: StepModel, factor: float) -> StepModel:
    """`model` on a replica that runs every step and prefill `factor` times as long."""
    if factor == 1.0:
        return model
    return replace(model, **{f: getattr(model, f) * factor for f in TIMING_FIELDS})


# Cost models the benches sweep: a policy must win on hardware it was not tuned for.
STEP_MODELS = {
    "default": StepModel(),
    # long contexts dominate: KV reads cost more, and less KV fits
    "kv_heavy": StepModel(kv_read_ns_per_token=30.0, kv_capacity_tokens=600_000, per_seq_us=20.0),
    # the per-sequence host work (sampling, scheduling) dominates
    "per_seq_heavy": StepModel(per_seq_us=60.0, kv_read_ns_per_token=6.0),
}


# Tail drafting profiles (applied with `drafted`): K=8 drafts per sequence while at most 16 run.
# `trained`: 1 + accepted / drafts, vLLM's counters over the tail arm of bench/drafting_real.py on the
# trained arithmetic model's two-layer build (docs/results/spec/drafting_real_two_layer.json: 5,726
# accepted in 3,364 drafts); the three-layer build gives 3.46 (drafting_real.json), not simulated;
# `pessimistic`: 1.5 tokens per pass.
DRAFTING = {
    "none": None,
    "trained": {"draft_tail_seqs": 16, "draft_tokens": 8, "tokens_per_pass": 2.7},
    "pessimistic": {"draft_tail_seqs": 16, "draft_tokens": 8, "tokens_per_pass": 1.5},
}


def drafted(model: StepModel, profile: str) -> StepModel:
    """`model` with the named DRAFTING profile (unchanged for "none")."""
    if profile not in DRAFTING:
        raise ValueError(f"drafting profile {profile!r}; known: {', '.join(DRAFTING)}")
    return replace(model, **DRAFTING[profile]) if DRAFTING[profile] else model


def token_weighted_context(lengths: np.ndarray, prompt_lens: np.ndarray) -> float:
    """Mean context seen by a decoded token: sum_i sum_t (P_i + t) / sum_i L_i."""
    lengths = np.asarray(lengths, dtype=np.float64)
    prompt_lens = np.asarray(prompt_lens, dtype=np.float64)
    total = lengths.sum()
    if total <= 0:
        return float(prompt_lens.mean()) if prompt_lens.size else 0.0
    return float((prompt_lens * lengths + lengths * (lengths + 1) / 2).sum() / total)


def _bound_inputs(lengths, prompt_lens, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return np.asarray(lengths, dtype=np.float64), np.asarray(prompt_lens, dtype=np.float64)


def lower_bound_s(lengths, prompt_lens, replicas: int, model: StepModel) -> float:
    """T* for these sequences on `replicas` replicas (see module docstring)."""
    lengths, prompt_lens = _bound_inputs(lengths, prompt_lens, replicas)
    if lengths.size == 0:
        return 0.0
    x_sat = model.saturated_tokens_per_s(token_weighted_context(lengths, prompt_lens))
    order = np.argsort(lengths, kind="stable")
    lengths, prompt_lens = lengths[order], prompt_lens[order]
    prompt_suffix = np.concatenate((np.cumsum(prompt_lens[::-1])[::-1], [0.0]))
    # The bracket is piecewise linear in k with breakpoints at the lengths, so checking
    # k = 0 and every distinct length finds the maximum.
    ks = np.concatenate(([0.0], np.unique(lengths)))
    suffix = np.concatenate((np.cumsum(lengths[::-1])[::-1], [0.0]))  # sum of lengths[j:]
    idx = np.searchsorted(lengths, ks, side="right")  # first index with length > k
    tail_tokens = suffix[idx] - ks * (lengths.size - idx)
    prefill_s = model.prefill_s(prompt_suffix[np.searchsorted(lengths, ks, side="left")])
    values = ks * model.lone_token_s + (tail_tokens / x_sat + prefill_s) / replicas
    return float(values.max())


def _kv_sums(lengths: np.ndarray, prompt_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: W_i = sum_{j<L_i} (p_i + j), and a lower bound of S_i = sum_{j<L_i} sqrt(p_i + j)."""
    w = lengths * prompt_lens + lengths * (lengths - 1) / 2
    # sqrt increases, so the sum over j = 0..L-1 is at least the integral from p - 1 to p + L - 1.
    low = np.maximum(prompt_lens - 1, 0.0)
    s = (2.0 / 3.0) * ((prompt_lens + lengths - 1).clip(min=0.0) ** 1.5 - low ** 1.5)
    return w, np.maximum(s, 0.0)


def lone_path_s(lengths, prompt_lens, model: StepModel) -> np.ndarray:
    """Each sequence decoding alone from its prefill on: a floor on its own finish time."""
    lengths = np.asarray(lengths, dtype=np.float64)
    prompt_lens = np.asarray(prompt_lens, dtype=np.float64)
    w, _ = _kv_sums(lengths, prompt_lens)
    return lengths * model.lone_token_s + model.kv_s * w + model.prefill_s(prompt_lens)


def lower_bound_dl_s(lengths, prompt_lens, replicas: int, model: StepModel, rel_tol: float = 1e-6) -> float:
    """T*_dl for these sequences on `replicas` replicas (see module docstring). With drafting, every
    decode cost is divided by tokens_per_pass and verification is free, as if every token could be
    drafted: still a bound, loose where the batch is too large to draft."""
    if model.draft_tail_seqs and model.tokens_per_pass > 1.0:
        f = 1.0 / model.tokens_per_pass
        model = replace(model, base_ms=model.base_ms * f, per_seq_us=model.per_seq_us * f,
                        kv_read_ns_per_token=model.kv_read_ns_per_token * f, draft_tail_seqs=0)
    lengths, prompt_lens = _bound_inputs(lengths, prompt_lens, replicas)
    if lengths.size == 0:
        return 0.0
    w, s = _kv_sums(lengths, prompt_lens)
    base_s, kv_s = model.base_ms * 1e-3, model.kv_s
    own_s = lengths * model.lone_token_s + model.prefill_s(prompt_lens)  # sequence i's steps without KV
    fixed_s = kv_s * w.sum() + model.per_seq_us * 1e-6 * lengths.sum() + model.prefill_s(prompt_lens.sum())
    slot_steps = lengths.sum() / model.max_num_seqs
    fill_steps = w / model.kv_capacity_tokens

    def short_s(t: float) -> float:
        """R T minus the work the makespan t forces (>= 0: t is feasible for this bound)."""
        if kv_s > 0:
            v = (t - own_s) / kv_s  # sum of K_s the steps of sequence i may read within t
            kv_steps = np.maximum(fill_steps, np.divide(s * s, v, out=np.full_like(v, np.inf), where=v > 0))
        else:
            kv_steps = fill_steps
        return replicas * t - (base_s * max(float(kv_steps.sum()), slot_steps) + fixed_s)

    lo = float(lone_path_s(lengths, prompt_lens, model).max())
    if short_s(lo) >= 0:
        return lo
    hi = max(lo, 1e-9) * 2
    while short_s(hi) < 0:
        hi *= 2
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if short_s(mid) >= 0 else (mid, hi)
    return hi
