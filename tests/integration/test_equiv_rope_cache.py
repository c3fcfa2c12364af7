"""rope_cache in real vLLM: token-identical to all-modules-off, and one cos/sin gather per forward.

Engine budget: three module runs, (qwen2, TP1, compiled), (llama, TP1, eager), (llama, TP2,
compiled), against the shared all-off baselines. The unpatched gather count (= decoder layers per
forward) is read from the eager baseline, where a probe counts vLLM's own per-layer gathers; a
compiled baseline's graph is traced before the probe exists, so it is not counted there.
"""

from __future__ import annotations

import json

import pytest

from rollout_ext.testing.equivalence import assert_equivalent, module_env

# fp32 tiny models: rope math moves from vLLM's CPU kernel (eager) or inductor (compiled) to the
# reference math in rollout_ext.ops.rotary, which can differ in the last bits.
LOGPROB_ATOL = 1e-4

RUNS = [("qwen2", 1, False), ("llama", 1, True), ("llama", 2, False)]


def max_logprob_diff(result, reference) -> float:
    worst = 0.0
    for req, (steps, ref_steps) in enumerate(zip(result.logprobs, reference.logprobs)):
        for step, (got, ref) in enumerate(zip(steps, ref_steps)):
            token = reference.tokens[req][step]
            worst = max(worst, abs(got[token] - ref[token]))
    return worst


@pytest.mark.heavy
@pytest.mark.parametrize("arch,tp,eager", RUNS, ids=[f"{a}-tp{t}-{'eager' if e else 'compiled'}" for a, t, e in RUNS])
def test_rope_cache_equivalent_with_one_gather_per_forward(arch, tp, eager, greedy_run, baseline, tiny_model_dir):
    reference = baseline(arch, tp, eager)
    result = greedy_run(arch, tp, eager, module_env(rope_cache="1"))
    print(f"{arch} tp{tp} eager={eager}: max |logprob diff| = {max_logprob_diff(result, reference):.3g}")
    print(f"patched counters: {result.rope_counters}; baseline counters: {reference.rope_counters}")
    assert_equivalent(result, reference, atol=LOGPROB_ATOL)
    assert "active=[rope_cache]" in result.log

    assert result.rope_counters is not None and len(result.rope_counters) == tp
    for counters in result.rope_counters:
        assert counters.get("patched") is True, counters
        assert counters["forwards"] > 0
        assert counters["step_gathers"] == counters["forwards"]  # one table, gathered once per forward
        assert counters["layer_gathers"] == 0  # no layer fell back to its own gather
        assert counters["gathers_per_forward"] == 1

    if eager:
        num_layers = json.loads((tiny_model_dir(arch) / "config.json").read_text())["num_hidden_layers"]
        for counters in reference.rope_counters:
            assert counters.get("patched") is False, counters
            assert counters["forwards"] > 0
            assert counters["layer_gathers"] == num_layers * counters["forwards"]
