"""Replicas of unequal speed: the simulator runs them, ReplicaSpeeds finds the slow ones, tail_aware avoids them."""

import statistics

import numpy as np
import pytest

from rollout_ext.balance import speeds as speeds_module
from rollout_ext.balance.policy import VerlDefaultPolicy
from rollout_ext.balance.predictor import LengthPredictor
from rollout_ext.balance.simulator import REPLICA_SPEEDS, simulate
from rollout_ext.balance.speeds import ESTIMATE_EVERY, ReplicaSpeeds
from rollout_ext.balance.step_model import StepModel
from rollout_ext.balance.tail_aware import TailAwarePolicy
from rollout_ext.balance.workload import WorkloadConfig, make_workload, warm_history


def test_a_replica_runs_its_speed_times_as_long():
    w = make_workload(WorkloadConfig(prompts=4, samples=4, mean_tokens=300, cap_tokens=2048, seed=1))
    model = StepModel(max_num_seqs=8, kv_capacity_tokens=40_000)
    runs = {speed: simulate(w, VerlDefaultPolicy(), 1, model=model, speeds=None if speed is None else [speed]).makespan_s
            for speed in (None, 1.0, 2.0)}
    assert runs[1.0] == runs[None]  # the control: speed 1 is the step model itself
    assert runs[2.0] == pytest.approx(2 * runs[1.0], rel=1e-9)


@pytest.mark.parametrize("speeds", [[1.0], [1.0, 1.0, 0.0], [1.0, -1.0, 1.0]])
def test_malformed_speeds_are_refused_by_name(speeds):
    w = make_workload(WorkloadConfig(prompts=2, samples=2, mean_tokens=100, cap_tokens=1024))
    with pytest.raises(ValueError, match=r"speeds must be 3 factors > 0 \(one per replica\)"):
        simulate(w, VerlDefaultPolicy(), 3, speeds=speeds)


def _observed(factors: dict[str, float], intervals: int = 400, noise: float = 0.05, common=lambda i: 1.0):
    """ReplicaSpeeds fed `intervals` intervals per replica, each `factor` x its model time, with
    multiplicative noise and a common factor that changes with the phase of the run."""
    rng = np.random.default_rng(0)
    speeds = ReplicaSpeeds()
    for rid in factors:
        speeds.add_replica(rid)
    for i in range(intervals):
        for rid, factor in factors.items():
            model_s = float(rng.uniform(0.5, 2.0))
            speeds.observe(rid, model_s * factor * common(i) * float(rng.lognormal(0.0, noise)), model_s)
    return speeds.slowdown


def test_equal_replicas_plan_as_one_speed_through_noise_and_phases():
    # The phase factor mimics the fit's error moving with the run (0.7 in the first wave of boundaries).
    speeds = _observed({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, common=lambda i: 0.7 if 100 <= i < 200 else 1.0)
    assert speeds == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}


def test_a_slow_replica_stands_out_beyond_the_deadband():
    speeds = _observed({"a": 1.0, "b": 1.0, "slow": 1.5, "d": 1.0})
    # Relative to the mean of the four, less the 10% deadband: 1.5 -> about 1.23. The others are 0.9x the
    # mean; a replica counts as slower than the others or as one of them, never as faster.
    assert speeds["slow"] == pytest.approx(1.23, rel=0.03)
    assert all(speeds[r] == 1.0 for r in "abd")
    # Control: 8% slower sits inside the deadband.
    assert _observed({"a": 1.0, "b": 1.0, "slow": 1.08, "d": 1.0})["slow"] == 1.0


def test_speeds_ignore_unknown_replicas_and_empty_intervals():
    speeds = ReplicaSpeeds()
    speeds.add_replica("a")
    assert not speeds.observe("gone", 1.0, 1.0)
    assert not any(speeds.observe("a", 0.0, 1.0) for _ in range(2 * ESTIMATE_EVERY))
    speeds.remove_replica("a")
    assert speeds.slowdown == {}


def test_a_small_fleet_is_re_estimated_once_per_round_of_intervals():
    # Two replicas on a short real run give a few dozen intervals in all: re-estimating only every
    # ESTIMATE_EVERY intervals left a replica at +200 ms per step learned as 1.0 in one run of
    # tests/integration/test_router_real.py (its intervals came after the last estimate).
    speeds = ReplicaSpeeds()
    for rid in ("fast", "slow"):
        speeds.add_replica(rid)
    assert not speeds.observe("fast", 1.0, 1.0)
    assert speeds.observe("slow", 9.0, 1.0)  # the second interval: a round of two
    assert speeds.slowdown["slow"] == pytest.approx(3.0 / 1.1) and speeds.slowdown["fast"] == 1.0
    # A fleet larger than ESTIMATE_EVERY still re-estimates every ESTIMATE_EVERY intervals.
    big = ReplicaSpeeds()
    for i in range(4 * ESTIMATE_EVERY):
        big.add_replica(f"r{i}")
    taken = [big.observe(f"r{i}", 2.0, 1.0) for i in range(4 * ESTIMATE_EVERY)]
    assert [i + 1 for i, t in enumerate(taken) if t] == [ESTIMATE_EVERY * k for k in range(1, 5)]


def test_evidence_counts_what_was_taken_and_left_out():
    speeds = ReplicaSpeeds()
    speeds.add_replica("a")
    speeds.observe("a", 2.0, 1.0)
    speeds.left_out("a")
    speeds.left_out("gone")  # a replica removed meanwhile: nothing to count
    assert speeds.evidence() == {"a": {"elapsed_s": 2.0, "model_s": 1.0, "intervals": 1, "left_out": 1}}


def _run(speed_profile: str, replicas: int = 4, learn: bool = True, monkeypatch=None):
    cfg = WorkloadConfig(prompts=16, samples=16, mean_tokens=3500, cap_tokens=20480, icc=0.6, seed=1)
    predictor = LengthPredictor()
    warm_history(predictor, make_workload(cfg, epoch=-1))
    if not learn:
        monkeypatch.setattr(speeds_module.ReplicaSpeeds, "observe", lambda self, *args: False)
    policy = TailAwarePolicy(predictor=predictor, model=StepModel())
    w = make_workload(cfg)
    speeds = REPLICA_SPEEDS[speed_profile](replicas)
    res = simulate(w, policy, replicas, model=StepModel(), chunk_tokens=1024, speeds=speeds)
    verl = statistics.fmean(simulate(w, VerlDefaultPolicy(seed=s), replicas, model=StepModel(), chunk_tokens=1024,
                                     speeds=speeds).makespan_s for s in range(3))
    return res.makespan_s, verl, policy.snapshot()["replica_slowdown"]


def test_tail_aware_moves_work_off_a_slow_replica(monkeypatch):
    """One replica of four runs 1.5x slower (REPLICA_SPEEDS["one_slow"]: r2). tail_aware learns it from
    its clock and moves the long survivors off it; blind to it, it leaves them there, as verl does."""
    makespan_s, verl_s, learned = _run("one_slow")
    assert learned["r2"] > 1.1 and all(learned[r] == 1.0 for r in ("r0", "r1", "r3")), learned
    blind_s, _, blind = _run("one_slow", learn=False, monkeypatch=monkeypatch)
    assert set(blind.values()) == {1.0}
    # Measured: 189.1 s learned, 260.9 s blind, verl_default 269.7 s (mean of 5 tie-break seeds).
    assert makespan_s < 0.85 * blind_s and makespan_s < 0.85 * verl_s


def test_tail_aware_sees_equal_replicas_as_equal():
    """The control of the test above: on equal replicas every learned speed stays exactly 1."""
    _, _, learned = _run("equal")
    assert set(learned.values()) == {1.0}
