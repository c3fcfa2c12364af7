"""Synthetic synchronous DAPO/GRPO rollout batch: long-tailed response lengths with prompt effects.

Model, per prompt i and sample j:

    log L_ij = mu + a_i + e_ij          (then capped at `cap_tokens`: a truncation spike)
    Var(a_i) = icc * sigma^2,  Var(e_ij) = (1 - icc) * sigma^2

- `icc` is the intra-class correlation: how much of the log-length variance the prompt explains.
- A fraction `outlier_frac` of samples are sibling outliers (e.g. a repetition loop): their
  e_ij is shifted up by N(2, 0.5^2) in log space, so many of them run to the cap.
- The prompt effect is partly visible through the prompt length (`prompt_len_corr`), which is
  what a prompt-length prior can learn.
- mu is solved so that the mean capped length equals `mean_tokens`.
- Epochs: a_i drifts between epochs, a_i(epoch) = sqrt(1-drift) * a_i + sqrt(drift) * fresh,
  and e_ij is fresh each epoch. History from epoch -1 therefore helps but is not perfect.
- Prompt hashes are stable across epochs (same prompt, same tokens), request ids are not.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadConfig:
    prompts: int = 512  # distinct prompts in the batch
    samples: int = 16  # responses per prompt (GRPO group size)
    mean_tokens: float = 3500.0  # mean response length after the cap
    cap_tokens: int = 20480  # max_tokens: responses are truncated here
    icc: float = 0.6  # share of log-length variance explained by the prompt
    log_sd: float = 1.0  # total sd of log length (before outliers and cap)
    outlier_frac: float = 0.03  # sibling outliers (repetition loops), 2-5% in DAPO logs
    prompt_len_corr: float = 0.3  # correlation of log prompt length with the prompt effect
    mean_prompt_tokens: float = 400.0  # mean prompt length
    drift: float = 0.3  # epoch-to-epoch share of the prompt effect that is redrawn
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "prompts": self.prompts >= 1,
            "samples": self.samples >= 1,
            "mean_tokens": 1 <= self.mean_tokens < self.cap_tokens,
            "cap_tokens": self.cap_tokens >= 2,
            "icc": 0.0 <= self.icc <= 1.0,
            "log_sd": self.log_sd > 0,
            "outlier_frac": 0.0 <= self.outlier_frac <= 1.0,
            "prompt_len_corr": -1.0 <= self.prompt_len_corr <= 1.0,
            "mean_prompt_tokens": self.mean_prompt_tokens >= 1,
            "drift": 0.0 <= self.drift <= 1.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"WorkloadConfig.{name}={getattr(self, name)!r} is out of range")


@dataclass(frozen=True, slots=True)
class Workload:
    """One epoch's batch; arrays are indexed by request (prompt-major, then sample)."""

    config: WorkloadConfig
    epoch: int
    request_ids: list[str]
    group_keys: list[str]  # same key for all samples of one prompt in this batch
    prompt_hashes: list[str]  # hash of the prompt tokens: stable across epochs
    sample_index: np.ndarray
    prompt_tokens: np.ndarray
    lengths: np.ndarray  # true response lengths (tokens), capped

    def __len__(self) -> int:
        return len(self.request_ids)


def _prompt_hash(seed: int, prompt: int) -> str:
    return hashlib.blake2b(f"{seed}:{prompt}".encode(), digest_size=8).hexdigest()


def make_workload(config: WorkloadConfig, epoch: int = 0) -> Workload:
    n, m = config.prompts, config.samples
    base = np.random.default_rng([config.seed, 0])
    z_prompt_len = base.standard_normal(n)
    z_effect = base.standard_normal(n)
    rng = np.random.default_rng([config.seed, 1, epoch + 1000])
    z_drift = rng.standard_normal(n)

    sd_a = math.sqrt(config.icc) * config.log_sd
    sd_e = math.sqrt(1.0 - config.icc) * config.log_sd
    rho = config.prompt_len_corr
    # Epoch 0 carries the stable part; other epochs redraw a `drift` share of it.
    z_a = rho * z_prompt_len + math.sqrt(1 - rho * rho) * z_effect
    if epoch != 0:
        z_a = math.sqrt(1 - config.drift) * z_a + math.sqrt(config.drift) * z_drift
    a = sd_a * z_a
    e = sd_e * rng.standard_normal((n, m))
    outliers = rng.random((n, m)) < config.outlier_frac
    e = e + outliers * rng.normal(2.0, 0.5, (n, m))
    z = (a[:, None] + e).ravel()

    mu = _solve_mu(z, config.mean_tokens, config.cap_tokens)
    lengths = np.clip(np.round(np.exp(mu + z)), 1, config.cap_tokens).astype(np.int64)

    prompt_sd = 0.6
    prompt_mu = math.log(config.mean_prompt_tokens) - prompt_sd**2 / 2
    prompt_tokens = np.clip(np.round(np.exp(prompt_mu + prompt_sd * z_prompt_len)), 16, 8192)
    prompt_tokens = np.repeat(prompt_tokens.astype(np.int64), m)

    hashes = [_prompt_hash(config.seed, i) for i in range(n)]
    return Workload(
        config=config,
        epoch=epoch,
        request_ids=[f"e{epoch}-p{i}-s{j}" for i in range(n) for j in range(m)],
        group_keys=[f"e{epoch}-p{i}" for i in range(n) for _ in range(m)],
        prompt_hashes=[hashes[i] for i in range(n) for _ in range(m)],
        sample_index=np.tile(np.arange(m), n),
        prompt_tokens=prompt_tokens,
        lengths=lengths,
    )


def _solve_mu(z: np.ndarray, mean_tokens: float, cap_tokens: int) -> float:
    """Bisection on mu so that mean(min(exp(mu + z), cap)) == mean_tokens (monotone in mu)."""
    lo, hi = -10.0, math.log(cap_tokens) + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.minimum(np.exp(mid + z), cap_tokens).mean() < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def requests_of(workload: Workload) -> list:
    """The batch as the policy sees it (no true lengths)."""
    from rollout_ext.balance.request import Request

    w = workload
    return [
        Request(w.request_ids[i], w.group_keys[i], int(w.sample_index[i]), int(w.prompt_tokens[i]),
                int(w.config.cap_tokens), w.prompt_hashes[i])
        for i in range(len(w))
    ]


def warm_history(predictor, workload: Workload) -> None:
    """Feed a finished epoch (e.g. epoch -1) to a predictor, as the trainer's last step would."""
    for request, length in zip(requests_of(workload), workload.lengths):
        predictor.observe(request, int(length), True)
    predictor.end_epoch()
