"""Step-time model, lower bound, workload and length predictor."""

import math

import numpy as np
import pytest

from rollout_ext.balance.predictor import LengthPredictor
from rollout_ext.balance.policy import OracleLPTPolicy, RoundRobinPolicy, VerlDefaultPolicy
from rollout_ext.balance.predictor import OraclePredictor
from rollout_ext.balance.simulator import simulate
from rollout_ext.balance.step_model import (STEP_MODELS, StepModel, drafted, lone_path_s, lower_bound_dl_s,
                                            lower_bound_s, token_weighted_context)
from rollout_ext.balance.tail_aware import TailAwarePolicy
from rollout_ext.balance.workload import WorkloadConfig, make_workload, requests_of, warm_history


def test_series_matches_stepping_and_inverse():
    m = StepModel()
    kv, b = 12_345, 37
    direct = sum(m.step_s(b, kv + j * b) for j in range(500))
    assert m.steps_s(b, kv, 500) == pytest.approx(direct, rel=1e-12)
    for n in (0, 1, 2, 499, 500):
        assert m.steps_within_s(b, kv, m.steps_s(b, kv, n) + 1e-12) == n


def test_bound_single_replica_and_single_sequence():
    m = StepModel()
    # One sequence: its own decode at tau_1 (plus its prefill) is the bound.
    assert lower_bound_s([1000], [100], 1, m) == pytest.approx(1000 * m.lone_token_s + m.prefill_s(100))
    # Many equal sequences on one replica: throughput term dominates.
    lengths, prompts = np.full(2000, 1000), np.full(2000, 100)
    x_sat = m.saturated_tokens_per_s(token_weighted_context(lengths, prompts))
    assert lower_bound_s(lengths, prompts, 1, m) >= 2000 * 1000 / x_sat
    # More replicas never raise the bound.
    assert lower_bound_s(lengths, prompts, 4, m) <= lower_bound_s(lengths, prompts, 1, m)


def test_dl_bound_single_sequence_is_its_lone_path_and_grows_with_kv_cost():
    m = StepModel()
    assert lower_bound_dl_s([1000], [100], 1, m) == pytest.approx(float(lone_path_s([1000], [100], m)[0]))
    lengths, prompts = np.r_[np.full(400, 500), [20000]], np.full(401, 200)
    cheap, dear = StepModel(kv_read_ns_per_token=6.0), StepModel(kv_read_ns_per_token=30.0)
    assert lower_bound_dl_s(lengths, prompts, 8, dear) > lower_bound_dl_s(lengths, prompts, 8, cheap)
    assert lower_bound_dl_s(lengths, prompts, 8, m) >= lower_bound_dl_s(lengths, prompts, 16, m)
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        lower_bound_dl_s(lengths, prompts, 0, m)


def _policies(w, model, seed):
    true = dict(zip(w.request_ids, map(int, w.lengths)))
    warm = LengthPredictor()
    warm_history(warm, make_workload(w.config, epoch=-1))
    return [RoundRobinPolicy(slots_per_replica=model.max_num_seqs, seed=seed),
            VerlDefaultPolicy(slots_per_replica=model.max_num_seqs, seed=seed),
            OracleLPTPolicy(predictor=OraclePredictor(true), slots_per_replica=model.max_num_seqs, seed=seed),
            TailAwarePolicy(predictor=warm, model=model, seed=seed)]


# Small KV and few slots force preemption and slot-bound batches, where the bounds are tightest.
BOUND_MODELS = {**STEP_MODELS, "cramped": StepModel(kv_capacity_tokens=60_000, max_num_seqs=16)}


@pytest.mark.parametrize("model_name", sorted(BOUND_MODELS))
def test_no_simulated_policy_beats_either_bound(model_name):
    model = BOUND_MODELS[model_name]
    tightest = 0.0
    for seed, replicas in ((1, 2), (2, 8), (3, 32)):
        w = make_workload(WorkloadConfig(prompts=48, samples=8, mean_tokens=1500, cap_tokens=8192, seed=seed))
        t_star = lower_bound_s(w.lengths, w.prompt_tokens, replicas, model)
        t_dl = lower_bound_dl_s(w.lengths, w.prompt_tokens, replicas, model)
        for policy in _policies(w, model, seed):
            makespan = simulate(w, policy, replicas, model=model, chunk_tokens=512).makespan_s
            assert makespan >= t_star * (1 - 1e-9), (policy.name, replicas, makespan, t_star)
            assert makespan >= t_dl * (1 - 1e-9), (policy.name, replicas, makespan, t_dl)
            tightest = max(tightest, t_dl / makespan)
    assert tightest > 0.95  # the bound is not vacuous: within 5% of the best policy somewhere


def test_drafting_changes_only_tail_steps_and_keeps_the_series_exact():
    plain, m = StepModel(), drafted(StepModel(), "trained")
    kv = 50_000
    # Above the tail threshold nothing changes; at or below it a token costs a pass plus the drafts'
    # compute, over the tokens a pass yields.
    assert m.step_s(17, kv) == plain.step_s(17, kv)
    assert m.step_s(16, kv) == pytest.approx((plain.step_s(16, kv) + m.prefill_s(16 * 8)) / 2.7)
    assert m.lone_token_s < plain.lone_token_s
    for b in (3, 16, 40):
        direct = sum(m.step_s(b, kv + j * b) for j in range(300))
        assert m.steps_s(b, kv, 300) == pytest.approx(direct, rel=1e-12)
        assert m.steps_within_s(b, kv, m.steps_s(b, kv, 300) + 1e-12) == 300
    with pytest.raises(ValueError, match="tokens_per_pass 12 in"):
        StepModel(draft_tail_seqs=16, draft_tokens=8, tokens_per_pass=12)


@pytest.mark.parametrize("profile", ["trained", "pessimistic"])
def test_no_drafted_policy_beats_the_drafted_bounds_and_drafting_shortens_the_tail(profile):
    for name in ("default", "kv_heavy"):
        plain = BOUND_MODELS[name]
        model = drafted(plain, profile)
        w = make_workload(WorkloadConfig(prompts=48, samples=8, mean_tokens=1500, cap_tokens=8192, seed=4))
        t_star = lower_bound_s(w.lengths, w.prompt_tokens, 8, model)
        t_dl = lower_bound_dl_s(w.lengths, w.prompt_tokens, 8, model)
        # Drafting lowers the bound itself (the control: the undrafted bound is above it).
        assert t_star < lower_bound_s(w.lengths, w.prompt_tokens, 8, plain)
        for policy, fresh in zip(_policies(w, model, 4), _policies(w, plain, 4)):
            makespan = simulate(w, policy, 8, model=model, chunk_tokens=512).makespan_s
            assert makespan >= max(t_star, t_dl) * (1 - 1e-9), (policy.name, makespan, t_star, t_dl)
            assert makespan < simulate(w, fresh, 8, model=plain, chunk_tokens=512).makespan_s, policy.name


def test_bound_check_catches_an_overstated_bound():
    """Control for the test above: the same check, with the bound built on twice the true costs, fails."""
    model = STEP_MODELS["default"]
    wrong = StepModel(base_ms=2 * model.base_ms, kv_read_ns_per_token=2 * model.kv_read_ns_per_token)
    w = make_workload(WorkloadConfig(prompts=48, samples=8, mean_tokens=1500, cap_tokens=8192, seed=2))
    policy = _policies(w, model, 2)[2]
    makespan = simulate(w, policy, 8, model=model, chunk_tokens=512).makespan_s
    assert makespan < lower_bound_dl_s(w.lengths, w.prompt_tokens, 8, wrong)


def test_token_weighted_context_exceeds_half_mean_for_long_tails():
    w = make_workload(WorkloadConfig(prompts=64, samples=8))
    ctx = token_weighted_context(w.lengths, w.prompt_tokens)
    assert ctx > w.lengths.mean() / 2 + w.prompt_tokens.mean()


def test_workload_shape():
    cfg = WorkloadConfig(prompts=256, samples=16, mean_tokens=3500, cap_tokens=20480, icc=0.6, seed=7)
    w = make_workload(cfg)
    assert len(w) == 256 * 16
    assert w.lengths.mean() == pytest.approx(3500, rel=0.01)
    assert w.lengths.max() == 20480 and (w.lengths == 20480).mean() > 0.005  # truncation spike
    logs = np.log(w.lengths).reshape(256, 16)
    between, within = logs.mean(1).var(), logs.var(1, ddof=1).mean()
    assert between > within / 16  # prompt effect present
    again = make_workload(cfg)
    assert np.array_equal(again.lengths, w.lengths)
    prev = make_workload(cfg, epoch=-1)
    assert prev.prompt_hashes == w.prompt_hashes and not np.array_equal(prev.lengths, w.lengths)


def _abs_log_err(pred, true):
    return float(np.mean(np.abs(np.log(np.maximum(pred, 1)) - np.log(true))))


def test_siblings_and_history_beat_the_prior():
    cfg = WorkloadConfig(prompts=128, samples=16, icc=0.8, seed=11)
    w, prev = make_workload(cfg), make_workload(cfg, epoch=-1)
    reqs = requests_of(w)
    late = np.array([r.sample_index >= 8 for r in reqs])

    cold = LengthPredictor()
    prior = np.array([cold.remaining_tokens(r, 0) for r in reqs])
    for r, n in zip(reqs, w.lengths):
        if r.sample_index < 8:
            cold.observe(r, int(n), True)
    siblings = np.array([cold.remaining_tokens(r, 0) for r in reqs])
    assert _abs_log_err(siblings[late], w.lengths[late]) < 0.85 * _abs_log_err(prior[late], w.lengths[late])

    warm = LengthPredictor()
    warm_history(warm, prev)
    history = np.array([warm.remaining_tokens(r, 0) for r in reqs])
    r_prior = np.corrcoef(np.log(prior), np.log(w.lengths))[0, 1] if np.ptp(np.log(prior)) > 1e-6 else 0.0
    r_hist = np.corrcoef(np.log(history), np.log(w.lengths))[0, 1]
    assert r_hist > max(r_prior, 0.0) + 0.2


def test_remaining_is_conditional_on_survival():
    cfg = WorkloadConfig(prompts=64, samples=16, seed=2)
    w = make_workload(cfg)
    p = LengthPredictor()
    warm_history(p, make_workload(cfg, epoch=-1))
    r = requests_of(w)[0]
    at = [p.remaining_tokens(r, g) + g for g in (0, 2000, 8000, 16000)]
    assert all(b > a for a, b in zip(at, at[1:]))  # surviving longer predicts a longer total
    assert p.remaining_tokens(r, r.max_tokens) == 0.0
    assert math.isfinite(p.remaining_tokens(r, r.max_tokens - 1))


def _remaining_by_quadrature(p, r, g, components):
    """E[min(L, cap) - g | L > g] under the predictor's posterior, integrated numerically over the
    per-sample noise (exact normal density), not by the closed form and its erfc approximation."""
    group = p._group(r)
    log_w = group.log_prior + group.total - group.own(r.sample_index)
    w = np.exp(log_w - log_w.max())
    e = np.linspace(-14.0, 14.0, 40001)
    num = den = 0.0
    for weight, shift, sd in components:
        density = np.exp(-0.5 * ((e - shift) / sd) ** 2) / sd
        for a, wa in zip(group.grid, w):
            length = np.exp(p._mu(r.prompt_len) + a + e)
            alive = density * (length > g)
            num += weight * wa * float(np.sum(alive * np.minimum(length, r.max_tokens)))
            den += weight * wa * float(np.sum(alive))
    return num / den - g


def test_remaining_matches_numerical_integration():
    cfg = WorkloadConfig(prompts=16, samples=8, seed=5)
    w = make_workload(cfg)
    p = LengthPredictor()
    warm_history(p, make_workload(cfg, epoch=-1))
    reqs = requests_of(w)
    for r, n in list(zip(reqs, w.lengths))[::3]:
        p.observe(r, int(n), True)  # finished siblings
    p.observe(reqs[1], 3000, False)  # and a running one
    for r in reqs[1:3]:
        for g in (0, 1500, 9000):
            want = _remaining_by_quadrature(p, r, g, p._components())
            assert p.remaining_tokens(r, g) == pytest.approx(want, rel=2e-3), (r.request_id, g)
    # Control: the same integral without the outlier component is far off, so the check can fail.
    _, shift, sd = p._components()[0]
    no_outliers = _remaining_by_quadrature(p, reqs[1], 9000, [(1.0, shift, sd)])
    assert abs(no_outliers / p.remaining_tokens(reqs[1], 9000) - 1) > 0.02


def test_calibration_reports_after_finishes():
    cfg = WorkloadConfig(prompts=8, samples=4, seed=4)
    w = make_workload(cfg)
    p = LengthPredictor()
    for r, n in zip(requests_of(w), w.lengths):
        p.observe(r, int(n), True, predicted_tokens=p.remaining_tokens(r, 0))
    cal = p.calibration()
    assert cal["finished"] == len(w) and cal["mean_abs_log_error"] >= 0


@pytest.mark.parametrize("icc", [0.3, 0.8])
def test_fitted_icc_tracks_the_workload(icc):
    """The mixing gate reads it: after one epoch the fit is within 0.1 of the workload's ICC."""
    p = LengthPredictor()
    assert p.icc() == pytest.approx(0.5)  # the cold-start prior
    warm_history(p, make_workload(WorkloadConfig(prompts=256, samples=16, icc=icc, seed=5), epoch=-1))
    assert abs(p.icc() - icc) < 0.1
