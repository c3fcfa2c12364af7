"""`python -m rollout_ext check` on a shape no module was built against, TP=2, as users run it.

The two module sets are the compatible pairs that touch tensor parallelism most: rope cache with
flashcomm (token-sharded residual stream) and MLP-only TP with mc2 (replicated attention, fused
row-parallel dispatch), both with thresholds at 1 so every step takes the new path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout_ext.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.heavy

MODULE_SETS = {
    "rope_cache+flashcomm": ["ROLLOUT_EXT_ROPE_CACHE=1", "ROLLOUT_EXT_FLASHCOMM=1"],
    "mlp_only_tp+mc2": ["ROLLOUT_EXT_MLP_ONLY_TP=1", "ROLLOUT_EXT_MC2=1"],
}
THRESHOLDS = ["ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS=1", "ROLLOUT_EXT_MC2_MIN_TOKENS=1"]


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("odd") / "tiny-qwen2-odd", arch="qwen2-odd", seed=3)


@pytest.mark.parametrize("name", sorted(MODULE_SETS))
def test_check_cli_tp2_identical(odd_model, engine_cache_env, name):
    sets = [arg for switch in MODULE_SETS[name] + THRESHOLDS for arg in ("--set", switch)]
    cmd = [sys.executable, "-m", "rollout_ext", "check", "--model", str(odd_model), "--tp", "2", "--enforce-eager", *sets]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", **engine_cache_env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IDENTICAL" in proc.stdout


def test_check_cli_rejects_conflicts_before_any_engine(odd_model):
    cmd = [sys.executable, "-m", "rollout_ext", "check", "--model", str(odd_model),
           "--set", "ROLLOUT_EXT_MC2=1", "--set", "ROLLOUT_EXT_FLASHCOMM=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "ROLLOUT_EXT_MC2=1 with ROLLOUT_EXT_FLASHCOMM=1" in proc.stderr
