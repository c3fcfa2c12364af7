"""Shared pytest fixtures: repository paths and tiny random-weight checkpoints.

Tiny models are built once into <repo>/.cache/models (idempotent, shared by every test run), so
tests never download anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout_ext.testing.tiny_model import build_tiny_model, default_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def python_exe() -> str:
    """The interpreter running the tests, for scripts started as subprocesses."""
    return sys.executable


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Factory: tiny_model_dir("qwen2" | "llama") -> path of a built fp32 checkpoint."""

    def build(arch: str = "qwen2") -> Path:
        return build_tiny_model(default_model_dir(arch), arch=arch)

    return build


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def engine_cache_env(repo_root) -> dict[str, str]:
    """Env entries that keep vLLM and inductor caches inside the repo for engine subprocesses."""
    cache = repo_root / ".cache"
    return {
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }


@pytest.fixture(scope="session")
def arith_model() -> Path:
    """The trained arithmetic model (`make setup` builds it; about 4 minutes if it is missing)."""
    from rollout_ext.testing.arith_model import build_arith_model, default_arith_dir

    return build_arith_model(default_arith_dir())
