"""MLP-only TP (and FAV2's refusal) inside real vLLM on CPU, against the shared all-off baselines.

Tolerance: with attention replicated, o_proj is one full matmul per rank instead of two partial
products summed by an all-reduce, so fp32 log-probs move by float rounding only (~1e-5 measured);
ATOL_LOGPROB = 1e-4 leaves room for that and nothing more. Tokens must be identical.

The compiled llama case runs here (one KV head: vLLM replicates it at TP=2 anyway). KV heads that
TP=2 divides, eager, are test_check_unseen_shape's mlp_only_tp+mc2 variant on a 6-head / 2-KV-head
qwen2 shape (bound in every process, token-identical).
"""

from __future__ import annotations

import re

import pytest

from rollout_ext.testing.equivalence import assert_equivalent, make_spec, module_env
from rollout_ext.testing.greedy import run_greedy

pytestmark = pytest.mark.heavy

ATOL_LOGPROB = 1e-4
MLP_ONLY_TP = module_env(mlp_only_tp="1")


def replicated_layers(log: str) -> dict[int, str]:
    """tp rank -> the construction line the patch logs for layer 0 on that rank."""
    found = re.findall(r"mlp_only_tp: model\.layers\.0\.self_attn\.attn replicated on tp rank (\d) of 2: (.*)", log)
    return {int(rank): line.strip() for rank, line in found}


# llama: 4 heads / 1 KV head of 64 -> q 256 + k 64 + v 64 rows; hidden 256.
QKV_SHAPE, O_SHAPE, HEADS = "(384, 256)", "(256, 256)", "4 query / 1 kv"


def test_mlp_only_tp_matches_sharded_attention(greedy_run, baseline):
    result = greedy_run("llama", 2, False, MLP_ONLY_TP)
    assert_equivalent(result, baseline("llama", 2, False), atol=ATOL_LOGPROB)
    # Proof it took effect: both ranks built full (unsharded) attention weights and head counts.
    layers = replicated_layers(result.log)
    assert sorted(layers) == [0, 1], result.log[-3000:]
    for line in layers.values():
        assert f"qkv_proj weight {QKV_SHAPE}, o_proj weight {O_SHAPE}, {HEADS} heads per rank" in line


def test_fav2_refuses_engine_start_on_cpu(tiny_qwen2, engine_cache_env):
    spec = make_spec(tiny_qwen2, tp=1, eager=True)
    spec.enable_chunked_prefill = False  # FAV2's own requirement, so the refusal is about the device
    with pytest.raises(RuntimeError) as failure:
        run_greedy(spec, {**engine_cache_env, **module_env(fav2="1")}, timeout_s=300)
    message = str(failure.value)
    assert "PatchError: rollout_ext module 'fav2' cannot bind on vLLM 0.27.1" in message
    assert "rollout_ext patch 'fav2_attention': device is cpu, but FAV2" in message
    assert "is NPU-only" in message
