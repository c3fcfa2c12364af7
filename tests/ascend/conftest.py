"""The Ascend-on-CPU lane's fixtures: where vllm-ascend's source is, and how scenarios run.

Every test here is marked `ascend_emulated`. The source is test data in ../shared/upstream (beside
the project root). Where it is missing the tests skip, saying where they looked, except under CI
(CI=true), which always has ../shared: there a missing tree fails the run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

LANE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(LANE_DIR))
import lane  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(LANE_DIR):
            item.add_marker(pytest.mark.ascend_emulated)


@pytest.fixture(scope="session")
def ascend_upstream() -> Path:
    path = lane.DEFAULT_UPSTREAM
    if not (path / "vllm_ascend" / "__init__.py").is_file():
        message = f"vllm-ascend main source not found at {path} (../shared/upstream beside the project root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI must have it")
        pytest.skip(message)
    return path
