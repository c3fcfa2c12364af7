"""flashcomm inside real vLLM (CPU, TP=2): greedy tokens equal the all-off baseline, and the
workers' log proves that steps really ran token-sharded (reduce-scatter instead of all-reduce).

FLASHCOMM_MIN_TOKENS=1 so every step is sharded, decode included: the batches of 1-4 decode
tokens and the 64-token prefill chunks cover token counts that TP=2 does not divide (padding).
In compiled mode a sharded step runs the model eagerly by design (see patches/flashcomm.py), so
the compiled case compares an eager sharded forward against vLLM's compiled graph. Eager TP=2 on a
qwen2 shape is test_check_unseen_shape's rope_cache+flashcomm variant (bound in every process,
token-identical), so this file runs the compiled llama case only.
"""

from __future__ import annotations

import re

import pytest

from rollout_ext.testing.equivalence import assert_equivalent, module_env

pytestmark = pytest.mark.heavy

ENV = module_env(FLASHCOMM="1", FLASHCOMM_MIN_TOKENS="1")
# fp32; eager vs eager is exact at TP=2, eager vs inductor differs by fp32 rounding only.
ATOL = 1e-4
STEPS = re.compile(r"rollout_ext flashcomm: (\d+) steps sharded, (\d+) reduce-scatters so far "
                   r"\(last step: (\d+) tokens padded to (\d+)")


def sharded_steps(log: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(g) for g in m.groups()) for m in STEPS.finditer(log)]


def test_flashcomm_tp2_matches_baseline(greedy_run, baseline):
    result = greedy_run("llama", 2, False, ENV)
    reference = baseline("llama", 2, False)
    assert_equivalent(result, reference, atol=ATOL)
    assert "active=[flashcomm]" in result.log
    steps = sharded_steps(result.log)
    # 12 generated tokens: at least 12 sharded forwards per rank; logged at powers of two.
    assert steps and max(s for s, *_ in steps) >= 8, steps
    # 2 decoder layers x (o_proj, down_proj) reduce-scatters per step, counted before the log line.
    assert all(scatters >= 4 * s for s, scatters, *_ in steps), steps
    assert sharded_steps(reference.log) == []
