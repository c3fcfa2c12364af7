"""mc2_row_parallel inside real vLLM (CPU, TP=2): greedy tokens equal the all-off baseline, and
the workers' log proves every row-parallel call went through the patch's dispatch.

MC2_MIN_TOKENS=1 so the dispatch's threshold passes on every step, decode included. On CPU the
tiny fp32 models are never MC2-eligible (fp16/bf16 only, and the CPU backend repacks weights),
so the dispatch takes vLLM's matmul + all-reduce inside the custom op; the fused branch itself
is covered by tests/unit/test_patch_mc2_row_parallel.py. Eager TP=2 on a qwen2 shape is
test_check_unseen_shape's mlp_only_tp+mc2 variant, so this file runs the compiled llama case only.
"""

from __future__ import annotations

import re

import pytest

from rollout_ext.testing.equivalence import assert_equivalent, module_env

pytestmark = pytest.mark.heavy

ENV = module_env(MC2="1", MC2_MIN_TOKENS="1")
# fp32 on CPU, same kernels on both sides: only the op boundary differs.
ATOL = 1e-4
CALLS = re.compile(r"rollout_ext mc2_row_parallel: (\d+) row-parallel calls dispatched, (\d+) fused")


def dispatched_calls(log: str) -> list[int]:
    return [int(m.group(1)) for m in CALLS.finditer(log)]


def test_mc2_tp2_matches_baseline(greedy_run, baseline):
    result = greedy_run("llama", 2, False, ENV)
    reference = baseline("llama", 2, False)
    assert_equivalent(result, reference, atol=ATOL)
    assert "active=[mc2]" in result.log
    calls = dispatched_calls(result.log)
    # 2 decoder layers x (o_proj, down_proj) x at least 12 steps = 48+; logged at powers of two.
    assert calls and max(calls) >= 32, calls
    assert dispatched_calls(reference.log) == []
