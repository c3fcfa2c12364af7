"""Sampling with drafting on vLLM's CPU backend: lossless only with patches/cpu_spec_sampling.py.

The trained arithmetic model, sampled at temperature 1 through real vLLM (rollout_ext.testing.arith_props)
four ways: drafting off; ngram drafting with rollout_ext's plugin (the patch applies on CPU); tail
drafting (ROLLOUT_EXT_TAIL_DRAFTING=1: suffix drafting while at most 16 of the 128 sequences run);
and ngram drafting on stock vLLM (VLLM_PLUGINS empty: no plugin, no patch), the control. Speculative
decoding must not change the distribution, so the reward and the length of the patched run must
match the run without drafting, within sampling noise; the control samples at garbage temperatures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

PROMPTS, SAMPLES, MAX_TOKENS = 32, 4, 256


def _run(model, out, engine_cache_env, speculative: str, plugins: str | None, switches: dict) -> dict:
    env = {**os.environ, **engine_cache_env, "PYTHONUNBUFFERED": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "0", **switches}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, "-m", "rollout_ext.testing.arith_props", "--model", str(model),
                           "--prompts", str(PROMPTS), "--samples", str(SAMPLES), "--max-tokens", str(MAX_TOKENS),
                           "--speculative", speculative, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    return {**result["summary"], "spec_decode": result["spec_decode"]}


@pytest.fixture(scope="module")
def runs(arith_model, tmp_path_factory, engine_cache_env):
    tmp = tmp_path_factory.mktemp("spec")
    return {name: _run(arith_model, tmp / f"{name}.json", engine_cache_env, spec, plugins, switches)
            for name, spec, plugins, switches in (
                ("off", "off", "rollout_ext", {}), ("ngram", "ngram", "rollout_ext", {}),
                ("tail", "off", "rollout_ext", {"ROLLOUT_EXT_TAIL_DRAFTING": "1"}), ("ngram_stock", "ngram", "", {}))}


def test_drafting_keeps_the_sampled_distribution_with_the_patch(runs):
    off, ngram = runs["off"], runs["ngram"]
    # 128 samples: the reward's standard error is about 0.04.
    assert abs(ngram["reward_mean"] - off["reward_mean"]) < 0.15, (off, ngram)
    assert 0.75 < ngram["lengths"]["mean"] / off["lengths"]["mean"] < 1.33, (off["lengths"], ngram["lengths"])
    assert ngram["greedy_accuracy"] == off["greedy_accuracy"]  # greedy: the same tokens either way


def test_tail_drafting_keeps_the_sampled_distribution_and_greedy_tokens(runs):
    off, tail = runs["off"], runs["tail"]
    assert off["spec_decode"]["draft_tokens"] == 0
    # It drafted, and some drafts were accepted (drafting ran, in the tail only: see the unit test).
    assert tail["spec_decode"]["accepted_tokens"] > 0, tail["spec_decode"]
    assert abs(tail["reward_mean"] - off["reward_mean"]) < 0.15, (off, tail)
    assert 0.75 < tail["lengths"]["mean"] / off["lengths"]["mean"] < 1.33, (off["lengths"], tail["lengths"])
    assert tail["greedy_accuracy"] == off["greedy_accuracy"]


def test_control_stock_vllm_samples_garbage_with_drafting(runs):
    off, stock = runs["off"], runs["ngram_stock"]
    assert stock["reward_mean"] < off["reward_mean"] - 0.25, (off, stock)
