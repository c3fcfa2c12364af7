"""`python -m rollout_ext check` on a shape no module was built against, TP=2, as users run it.

The two module sets are the compatible pairs that touch tensor parallelism most: rope cache with
flashcomm (token-sharded residual stream) and MLP-only TP with mc2 (replicated attention, fused
row-parallel dispatch), both with thresholds at 1 so every step takes the new path. Tail drafting
runs beside them, at TP=2 and TP=1: lossless means token-identical greedy output, with drafts
verified and accepted (a run that drafted nothing is reported NOT BOUND).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rollout_ext.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.heavy

THRESHOLDS = ["ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS=1", "ROLLOUT_EXT_MC2_MIN_TOKENS=1"]


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("odd") / "tiny-qwen2-odd", arch="qwen2-odd", seed=3)


def _check(model, engine_cache_env, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rollout_ext", "check", "--model", str(model), "--enforce-eager", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", **engine_cache_env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _accepted(stdout: str, variant: str) -> int:
    line = re.search(rf"^{re.escape(variant)}: IDENTICAL (\{{.*\}})$", stdout, re.M)
    assert line, stdout
    return json.loads(line[1])["spec_decode"]["accepted_tokens"]


def test_check_cli_tp2_identical(odd_model, engine_cache_env):
    sets = [arg for switch in THRESHOLDS for arg in ("--set", switch)]
    variants = ["--variant", "rope_cache+flashcomm", "--variant", "mlp_only_tp+mc2", "--variant", "tail_drafting"]
    proc = _check(odd_model, engine_cache_env, "--tp", "2", "--max-tokens", "64", *variants, *sets)
    assert "rope_cache+flashcomm: IDENTICAL" in proc.stdout and "mlp_only_tp+mc2: IDENTICAL" in proc.stdout
    assert _accepted(proc.stdout, "tail_drafting") > 0
    assert "3/3 variants bound and token-identical" in proc.stdout


def test_tail_drafting_is_token_identical_at_tp1(odd_model, engine_cache_env):
    proc = _check(odd_model, engine_cache_env, "--max-tokens", "64", "--variant", "tail_drafting")
    assert _accepted(proc.stdout, "tail_drafting") > 0


def test_check_cli_rejects_bad_input_before_any_engine(odd_model):
    base = [sys.executable, "-m", "rollout_ext", "check", "--model", str(odd_model)]
    proc = subprocess.run(base + ["--variant", "mc2+flashcomm"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "ROLLOUT_EXT_MC2=1 with ROLLOUT_EXT_FLASHCOMM=1" in proc.stderr
    proc = subprocess.run(base + ["--variant", "rope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown module 'rope'" in proc.stderr and "rope_cache" in proc.stderr
