"""Engine fixtures for integration tests: one cached all-modules-off baseline per configuration.

Engines run with vLLM's EngineCore in the run's own process (GreedySpec.engine_in_process), the
cheapest real layout: ~17 s for TP=1 and ~35 s for TP=2 on a 2-core CPU. Even so, baselines are
computed once per session and shared by every equivalence test that asks for the same
(arch, tp, eager) configuration.
"""

from __future__ import annotations

import pytest

from rollout_ext.testing.equivalence import OFF_ENV, make_spec
from rollout_ext.testing.greedy import GreedyResult, run_greedy

@pytest.fixture(scope="session")
def greedy_run(tiny_model_dir, engine_cache_env):
    """greedy_run(arch, tp, eager, env, in_process=True) -> GreedyResult; cached per session."""
    cache: dict[tuple, GreedyResult] = {}

    def run(arch: str, tp: int, eager: bool, env: dict[str, str], in_process: bool = True) -> GreedyResult:
        key = (arch, tp, eager, tuple(sorted(env.items())), in_process)
        if key not in cache:
            spec = make_spec(tiny_model_dir(arch), tp, eager)
            spec.engine_in_process = in_process
            cache[key] = run_greedy(spec, {**engine_cache_env, **env})
        return cache[key]

    return run


@pytest.fixture(scope="session")
def baseline(greedy_run):
    """baseline(arch, tp, eager) -> the all-modules-off GreedyResult."""

    def get(arch: str, tp: int, eager: bool) -> GreedyResult:
        return greedy_run(arch, tp, eager, OFF_ENV)

    return get
