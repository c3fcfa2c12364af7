"""Engine fixtures for integration tests: one cached all-modules-off baseline per configuration.

Every engine start costs ~40 s on a 2-core CPU, so baselines are computed once per session and
shared by every equivalence test that asks for the same (arch, tp, eager) configuration.
"""

from __future__ import annotations

import pytest

from rollout_ext.testing.equivalence import OFF_ENV, make_spec
from rollout_ext.testing.greedy import GreedyResult, run_greedy

@pytest.fixture(scope="session")
def greedy_run(tiny_model_dir, engine_cache_env):
    """greedy_run(arch, tp, eager, env) -> GreedyResult; results are cached per session."""
    cache: dict[tuple, GreedyResult] = {}

    def run(arch: str, tp: int, eager: bool, env: dict[str, str]) -> GreedyResult:
        key = (arch, tp, eager, tuple(sorted(env.items())))
        if key not in cache:
            spec = make_spec(tiny_model_dir(arch), tp, eager)
            cache[key] = run_greedy(spec, {**engine_cache_env, **env})
        return cache[key]

    return run


@pytest.fixture(scope="session")
def baseline(greedy_run):
    """baseline(arch, tp, eager) -> the all-modules-off GreedyResult."""

    def get(arch: str, tp: int, eager: bool) -> GreedyResult:
        return greedy_run(arch, tp, eager, OFF_ENV)

    return get
