"""The DAPO pieces of the CPU example: dynamic-sampling filter and overlong penalty (no engine)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def example(repo_root):
    spec = importlib.util.spec_from_file_location("dapo_tiny_cpu", repo_root / "examples" / "dapo_tiny_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["dapo_tiny_cpu"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("dapo_tiny_cpu", None)


def test_filter_keeps_only_groups_whose_metric_varies(example):
    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    acc = np.array([0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    assert example.kept_groups(uids, acc) == ["a"]


def test_overlong_penalty_matches_dapo(example):
    # max 32, buffer 8: free up to 24 tokens, then linear down to -factor at 32
    assert example.overlong_penalty(20, 32, 8, 1.0) == 0.0
    assert example.overlong_penalty(24, 32, 8, 1.0) == 0.0
    assert example.overlong_penalty(28, 32, 8, 1.0) == -0.5
    assert example.overlong_penalty(32, 32, 8, 0.5) == -0.5


def test_rule_reward(repo_root):
    spec = importlib.util.spec_from_file_location("arith_reward", repo_root / "examples" / "arith_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    assert reward.compute_score("arith", "so 3 + 4 = 7", "7") == {"score": 1.0, "acc": 1.0}
    assert reward.compute_score("arith", "7 then 8", "7")["acc"] == 0.0
    assert reward.compute_score("arith", "", "7")["score"] == 0.0
