"""Online response-length predictor: expected remaining tokens of a request given what it has done.

Model (matches how lengths behave in GRPO groups, not one workload's constants):

    log L = mu(P) + a + e,   mu(P) = mu0 + beta * (log P - log_p_mean)

- `a` is the prompt effect shared by all samples of a prompt; `e` is per sample, a mixture of
  a main normal and a broad, upward-shifted outlier component (repetition loops), so a sample
  that outlives its siblings by far is predicted to keep running (the survival view).
- Lengths are capped at the request's max_tokens; a capped response is a censored observation.
- Per group (prompt in this batch) we keep a posterior over `a` on a fixed grid. Evidence:
  finished siblings (exact), running siblings at g tokens (censored: L > g), and the prior.
- The prior for `a` comes from the same prompt's lengths in the previous epoch (keyed by a hash
  of the prompt tokens, shrunk by `history_rho` for drift), else from the prompt-length prior.
- Remaining length of a request at g tokens is E[min(L, cap) - g | L > g, siblings], computed
  in closed form per grid point and component (lognormal partial expectations).
- `end_epoch()` refits mu0, beta, the prompt and sample spreads from the finished epoch and
  moves per-prompt means into the history. All tables are LRU-capped (bounded memory).
- Calibration: the prediction used at dispatch (g = 0) is compared with the true length at
  finish; `calibration()` reports mean |log(pred / true)| for it and for the prior alone.

`OraclePredictor` has the same interface and knows the true lengths (reference runs only).
`HindsightPredictor` knows them too, but reveals one only once its sequence has started: at
dispatch it answers as the predictor it wraps (reference runs only).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from rollout_ext.balance.request import Request

_SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictorConfig:
    prior_mean_tokens: float = 2000.0  # cold-start guess of the mean length (no history yet)
    prior_log_sd: float = 1.0  # cold-start total sd of log length
    prior_icc: float = 0.5  # cold-start share of variance explained by the prompt
    outlier_frac: float = 0.05  # weight of the outlier component in e
    outlier_shift: float = 1.0  # log-space shift of the outlier component
    outlier_sd: float = 1.5  # log-space sd of the outlier component
    history_rho: float = 0.8  # carry-over of a prompt's effect to the next epoch (before refit)
    grid_points: int = 41  # grid size of the posterior over the prompt effect
    max_groups: int = 65536  # LRU cap on live groups
    max_history: int = 262144  # LRU cap on remembered prompts

    def __post_init__(self) -> None:
        if self.prior_mean_tokens <= 0 or self.prior_log_sd <= 0:
            raise ValueError("PredictorConfig prior_mean_tokens and prior_log_sd must be > 0")
        if not 0.0 < self.prior_icc < 1.0:
            raise ValueError(f"PredictorConfig.prior_icc must be in (0, 1), got {self.prior_icc}")
        if not 0.0 <= self.outlier_frac < 1.0:
            raise ValueError(f"PredictorConfig.outlier_frac must be in [0, 1), got {self.outlier_frac}")
        if not 0.0 <= self.history_rho <= 1.0:
            raise ValueError(f"PredictorConfig.history_rho must be in [0, 1], got {self.history_rho}")
        if self.grid_points < 5 or self.max_groups < 1 or self.max_history < 1:
            raise ValueError("PredictorConfig grid_points >= 5, max_groups/max_history >= 1")


def _log_sf(z: np.ndarray) -> np.ndarray:
    """log P(N(0,1) > z), stable in the upper tail (A&S 7.1.26 erfc form)."""
    z = np.asarray(z, dtype=np.float64)
    x = np.abs(z) / _SQRT2
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    log_erfc_pos = np.log(np.maximum(poly, 1e-300)) - x * x
    upper = log_erfc_pos - math.log(2.0)  # z >= 0
    lower = np.log1p(-0.5 * np.exp(log_erfc_pos))  # z < 0: 1 - sf(-z)
    return np.where(z >= 0, upper, lower)


def _sf(z: np.ndarray) -> np.ndarray:
    return np.exp(_log_sf(z))


class LengthPredictor:
    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        c = self.config
        sd2 = c.prior_log_sd**2
        self.sd_a = math.sqrt(c.prior_icc * sd2)
        self.sd_e = math.sqrt((1 - c.prior_icc) * sd2)
        self.mu0 = math.log(c.prior_mean_tokens) - sd2 / 2
        self.beta = 0.0
        self.log_p_mean = 0.0  # the prompt-length centre: unused until the first refit sets it and beta
        self.rho = c.history_rho
        self._unit_grid = np.linspace(-4.0, 4.0, c.grid_points)
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._history: OrderedDict[str, tuple[float, int]] = OrderedDict()  # hash -> (mean log, n)
        self._epoch: OrderedDict[str, _EpochPrompt] = OrderedDict()  # group -> its finished lengths this epoch
        self._calib = [0, 0.0, 0.0, 0.0]  # n, sum |log err|, sum log err, sum |log err| of prior

    # ---- evidence -------------------------------------------------------------------------
    def observe(self, request: Request, generated_tokens: int, finished: bool,
                predicted_tokens: float | None = None) -> None:
        """A request reached `generated_tokens`; `finished` means it stopped there. `predicted_tokens`:
        the length predicted for it at dispatch, which `calibration()` compares with the true one."""
        group = self._group(request)
        cap = request.max_tokens
        censored = (not finished) or generated_tokens >= cap
        if generated_tokens <= 0 and censored:
            return
        group.set_obs(request.sample_index, math.log(max(1, generated_tokens)), censored, self)
        if finished:
            self._record_finish(request, generated_tokens, group, predicted_tokens)

    def _record_finish(self, request: Request, length: int, group: _Group, predicted_tokens: float | None) -> None:
        length = max(1, length)  # an empty response (an abort) must not put log(0) in the refit
        rec = self._epoch.get(request.group_key)
        if rec is None:
            rec = _EpochPrompt(request.prompt_hash, math.log(max(1, request.prompt_len)))
            self._epoch[request.group_key] = rec
            _trim(self._epoch, self.config.max_groups)
        rec.lengths.append(length)
        if predicted_tokens is not None:
            err = math.log(max(1.0, predicted_tokens) / length)
            self._calib[0] += 1
            self._calib[1] += abs(err)
            self._calib[2] += err
            self._calib[3] += abs(math.log(max(1.0, group.prior_prediction) / length))

    # ---- prediction -----------------------------------------------------------------------
    def remaining_tokens(self, request: Request, generated_tokens: int) -> float:
        cap = request.max_tokens
        g = max(0, generated_tokens)
        if g >= cap:
            return 0.0
        group = self._group(request)
        log_w = group.log_prior + group.total - group.own(request.sample_index)
        w = np.exp(log_w - log_w.max())
        weight, shift, sd = map(np.array, zip(*self._components()))
        shift, sd = shift[:, None], sd[:, None]
        m = self._mu(request.prompt_len) + group.grid + shift  # (component, grid)
        log_cap = math.log(cap)
        # One call for every survival term (the per-call cost of numpy dominates on grids this small).
        # z of L > x is (log x - m) / sd; the partial expectation's is that minus sd.
        logs = np.array([math.log(g), log_cap] if g > 0 else [log_cap])[:, None, None]
        z = (logs - m) / sd
        sf = _sf(np.concatenate((z, z - sd)))
        if g > 0:
            surv_g, surv_cap, inside_g, inside_cap = sf
        else:
            surv_cap, inside_cap = sf
            surv_g = inside_g = np.ones_like(m)
        mean_inside = np.exp(m + sd * sd / 2) * (inside_g - inside_cap)
        num = float(weight @ ((np.maximum(mean_inside, 0.0) + cap * surv_cap) @ w))
        den = float(weight @ (surv_g @ w))
        if den <= 1e-300:
            return float(cap - g)  # beyond anything the model expects: assume it runs to the cap
        expected_total = min(float(cap), max(num / den, g + 1.0))
        return expected_total - g

    def icc(self) -> float:
        """Share of log-length variance the prompt explains, as last fitted (how much siblings tell)."""
        return self.sd_a**2 / (self.sd_a**2 + self.sd_e**2)

    def calibration(self) -> dict:
        n, abs_err, err, prior_err = self._calib
        if n == 0:
            return {"finished": 0}
        return {
            "finished": n,
            "mean_abs_log_error": abs_err / n,  # prediction used at dispatch vs true length
            "mean_log_bias": err / n,  # > 0: over-predicts
            "prior_mean_abs_log_error": prior_err / n,  # prompt-length / history prior alone
        }

    # ---- epochs ---------------------------------------------------------------------------
    def end_epoch(self) -> None:
        """Refit the population model on this epoch's finished groups; remember prompt means."""
        groups = [r for r in self._epoch.values() if len(r.lengths) >= 2]
        if len(groups) >= 8:
            log_p = np.array([r.log_prompt for r in groups])
            means = np.array([np.mean(np.log(r.lengths)) for r in groups])
            within = np.concatenate([np.log(r.lengths) - np.mean(np.log(r.lengths)) for r in groups])
            sizes = np.array([len(r.lengths) for r in groups])
            # Robust within-group spread: outliers belong to the outlier component.
            sd_e = 1.4826 * float(np.median(np.abs(within))) * math.sqrt(np.mean(sizes / np.maximum(sizes - 1, 1)))
            self.log_p_mean = float(log_p.mean())
            x = log_p - self.log_p_mean
            self.beta = float((x @ (means - means.mean())) / max(x @ x, 1e-9))
            self.mu0 = float(means.mean())
            resid = means - self.mu0 - self.beta * x
            var_a = float(resid.var()) - sd_e**2 / float(sizes.mean())
            self.sd_e = max(sd_e, 0.05)
            self.sd_a = math.sqrt(max(var_a, 0.01))
            self._refit_rho(groups, resid)
            for r, res in zip(groups, resid):
                self._history[r.prompt_hash] = (float(res + self.mu0 + self.beta * (r.log_prompt - self.log_p_mean)),
                                                len(r.lengths))
                self._history.move_to_end(r.prompt_hash)
            _trim(self._history, self.config.max_history)
        self._epoch.clear()
        self._groups.clear()

    def _refit_rho(self, groups: list, resid: np.ndarray) -> None:
        prev, now = [], []
        for r, res in zip(groups, resid):
            h = self._history.get(r.prompt_hash)
            if h is not None:
                prev.append(h[0] - self.mu0 - self.beta * (r.log_prompt - self.log_p_mean))
                now.append(res)
        if len(prev) >= 30 and self.sd_a > 0:
            cov = float(np.mean(np.array(prev) * np.array(now)))
            self.rho = min(0.98, max(0.0, cov / self.sd_a**2))

    # ---- internals ------------------------------------------------------------------------
    def _mu(self, prompt_len: int) -> float:
        return self.mu0 + self.beta * (math.log(max(1, prompt_len)) - self.log_p_mean)

    def _components(self):
        c = self.config
        return ((1 - c.outlier_frac, 0.0, self.sd_e), (c.outlier_frac, c.outlier_shift, c.outlier_sd))

    def _group(self, request: Request) -> _Group:
        group = self._groups.get(request.group_key)
        if group is None:
            mean_a, sd = 0.0, self.sd_a
            h = self._history.get(request.prompt_hash)
            if h is not None:
                resid = h[0] - self._mu(request.prompt_len)
                shrink = self.sd_a**2 / (self.sd_a**2 + self.sd_e**2 / h[1])
                var_prev = 1.0 / (1.0 / self.sd_a**2 + h[1] / self.sd_e**2)
                mean_a = self.rho * shrink * resid
                sd = math.sqrt(self.rho**2 * var_prev + (1 - self.rho**2) * self.sd_a**2)
            group = _Group(mean_a + max(sd, 1e-3) * self._unit_grid, -0.5 * self._unit_grid**2)
            # The prompt-length prior alone (no history, no siblings), for calibration reports.
            group.prior_prediction = math.exp(self._mu(request.prompt_len) + 0.5 * (self.sd_a**2 + self.sd_e**2))
            group.prior_prediction = min(group.prior_prediction, float(request.max_tokens))
            group.prompt_len = request.prompt_len
            self._groups[request.group_key] = group
            _trim(self._groups, self.config.max_groups)
        else:
            self._groups.move_to_end(request.group_key)
        return group

    def loglik(self, grid: np.ndarray, log_value: float, censored: bool, prompt_len: int) -> np.ndarray:
        mu = self._mu(prompt_len) + grid
        out = None
        for weight, shift, sd in self._components():
            z = (log_value - mu - shift) / sd
            term = _log_sf(z) if censored else -0.5 * z * z - math.log(sd)
            term = term + math.log(max(weight, 1e-300))
            out = term if out is None else np.logaddexp(out, term)
        return out


@dataclass(slots=True)
class _EpochPrompt:
    """One prompt's finished lengths in the current epoch: what `end_epoch` refits from."""

    prompt_hash: str
    log_prompt: float  # log of its prompt tokens
    lengths: list[int] = field(default_factory=list)


class _Group:
    __slots__ = ("grid", "log_prior", "total", "_own", "prior_prediction", "prompt_len")

    def __init__(self, grid: np.ndarray, log_prior: np.ndarray) -> None:
        self.grid = grid
        self.log_prior = log_prior
        self.total = np.zeros_like(grid)
        self._own: dict[int, np.ndarray] = {}
        self.prior_prediction = 0.0
        self.prompt_len = 1

    def own(self, sample: int):
        return self._own.get(sample, 0.0)

    def set_obs(self, sample: int, log_value: float, censored: bool, predictor: LengthPredictor) -> None:
        new = predictor.loglik(self.grid, log_value, censored, self.prompt_len)
        old = self._own.get(sample)
        if old is not None:
            self.total = self.total - old
        self.total = self.total + new
        self._own[sample] = new


class OraclePredictor:
    """Knows each request's true length: for reference runs (oracle_lpt, oracle-predicted tail_aware)."""

    def __init__(self, true_lengths: dict[str, int]) -> None:
        self._true = dict(true_lengths)

    def observe(self, request: Request, generated_tokens: int, finished: bool,
                predicted_tokens: float | None = None) -> None:
        pass

    def remaining_tokens(self, request: Request, generated_tokens: int) -> float:
        return float(max(0, self._true[request.request_id] - generated_tokens))

    def icc(self) -> float:
        return 1.0

    def calibration(self) -> dict:
        return {"oracle": True}

    def end_epoch(self) -> None:
        pass


class HindsightPredictor:
    """Predicts a request's length with `inner` until it has generated a token, then knows the rest.

    A yardstick for moves: what re-dispatch reaches when every survivor's remaining length is known
    exactly, while placement still has only the prediction (reference runs only)."""

    def __init__(self, inner, true_lengths: dict[str, int]) -> None:
        self.inner = inner
        self._oracle = OraclePredictor(true_lengths)

    def observe(self, request: Request, generated_tokens: int, finished: bool,
                predicted_tokens: float | None = None) -> None:
        self.inner.observe(request, generated_tokens, finished, predicted_tokens)

    def remaining_tokens(self, request: Request, generated_tokens: int) -> float:
        started = self._oracle if generated_tokens > 0 else self.inner
        return started.remaining_tokens(request, generated_tokens)

    def icc(self) -> float:
        return self.inner.icc()

    def calibration(self) -> dict:
        return {**self.inner.calibration(), "hindsight": True}

    def end_epoch(self) -> None:
        self.inner.end_epoch()


def _trim(table: OrderedDict, cap: int) -> None:
    while len(table) > cap:
        table.popitem(last=False)
