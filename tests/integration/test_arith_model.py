"""The trained arithmetic model through real vLLM: it solves the task, its reward is neither 0 nor 1,
and its sampled lengths have a tail. Controls: an untrained checkpoint, and the greedy responses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rollout_ext.testing.arith_model import MIN_GREEDY_ACCURACY, REPORT_NAME, build_arith_model


def _properties(model, out, engine_cache_env, *args):
    env = {**os.environ, **engine_cache_env, "PYTHONUNBUFFERED": "1",
           # One process for the engine core, and no AOT compile that vLLM 0.27.1 cannot load back.
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0"}
    proc = subprocess.run([sys.executable, "-m", "rollout_ext.testing.arith_props", "--model", str(model),
                           "--json", str(out), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_trained_model_passes_every_check_and_the_greedy_control_fails_two(arith_model, tmp_path,
                                                                                engine_cache_env):
    # The build's own held-out evaluation (HF greedy) cleared the floor the build warns under.
    report = json.loads((arith_model / REPORT_NAME).read_text())
    assert report["accuracy"]["overall"] >= MIN_GREEDY_ACCURACY, report["accuracy"]
    result, stdout = _properties(arith_model, tmp_path / "props.json", engine_cache_env)
    summary = result["summary"]
    assert all(result["checks"].values()), summary
    assert summary["lengths"]["n"] == 64 * 16
    # The table and two sample responses are printed.
    assert "ICC of log length" in stdout and "example 2: Q:" in stdout
    # Lengths follow the prompt: 8 operands run longer than 2.
    assert summary["by_num_operands"]["8"]["p50"] > 3 * summary["by_num_operands"]["2"]["p50"]
    # Control: greedy responses are right too often for the reward band, and their lengths have
    # no sampled tail.
    greedy_checks = list(result["greedy_checks"].values())
    assert greedy_checks == [True, False, False], result["greedy_summary"]


def test_an_untrained_checkpoint_fails_the_accuracy_and_reward_checks(tmp_path, engine_cache_env):
    model = build_arith_model(tmp_path / "untrained", steps=20, eval_per_operand_count=1, progress=lambda _: None)
    result, _ = _properties(model, tmp_path / "props.json", engine_cache_env, "--prompts", "16",
                            "--samples", "4")
    report = json.loads((model / REPORT_NAME).read_text())
    assert report["accuracy"]["overall"] < MIN_GREEDY_ACCURACY  # control for the build's floor
    accuracy_ok, reward_ok, _tail_ok = result["checks"].values()
    assert not accuracy_ok and not reward_ok, result["summary"]
