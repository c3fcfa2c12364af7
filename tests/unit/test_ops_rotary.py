"""Rotary reference vs vLLM 0.27.1's real RotaryEmbedding.forward_native on CPU (bit for bit in fp32)."""

import pytest
import torch

from rollout_ext.ops import npu_available
from rollout_ext.ops.rotary import apply_rotary, apply_rotary_reference, gather_cos_sin

import vllm.config as vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding  # noqa: E402


def vllm_rope(head_size, rotary_dim, is_neox, dtype=torch.float32, max_pos=512, base=10000.0):
    with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
        return RotaryEmbedding(head_size, rotary_dim, max_pos, base, is_neox, dtype)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size, rotary_dim", [(128, 128), (64, 64), (80, 80), (128, 64), (128, 32)])
def test_ops_rotary_reference_equals_vllm_forward_native(is_neox, head_size, rotary_dim):
    rope = vllm_rope(head_size, rotary_dim, is_neox)
    gen = torch.Generator().manual_seed(head_size + rotary_dim)
    positions = torch.randint(0, 512, (13,), generator=gen)
    query = torch.randn(13, 6 * head_size, generator=gen)
    key = torch.randn(13, 2 * head_size, generator=gen)
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    cos, sin = gather_cos_sin(rope.cos_sin_cache, positions)
    got_q, got_k = apply_rotary_reference(
        query, key, cos, sin, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_ops_rotary_key_none_and_bf16():
    rope = vllm_rope(128, 128, True, dtype=torch.bfloat16)
    positions = torch.arange(7)
    query = torch.randn(7, 4 * 128).to(torch.bfloat16)
    want_q, _ = rope.forward_native(positions, query.clone(), None)
    cos, sin = gather_cos_sin(rope.cos_sin_cache, positions)
    got_q, got_k = apply_rotary_reference(query, None, cos, sin, head_size=128, rotary_dim=128, is_neox=True)
    assert got_k is None and torch.equal(got_q, want_q)


def test_ops_rotary_gather_cos_sin_matches_vllm_chunk():
    rope = vllm_rope(64, 64, True)
    positions = torch.tensor([[3, 0], [511, 7]])
    cos, sin = gather_cos_sin(rope.cos_sin_cache, positions)
    assert cos.shape == sin.shape == (4, 32)
    want_cos, want_sin = rope.cos_sin_cache[positions.flatten()].chunk(2, dim=-1)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_ops_rotary_dispatch_on_cpu_is_reference():
    assert not npu_available()
    rope = vllm_rope(64, 64, False)
    positions = torch.arange(5)
    query, key = torch.randn(5, 128), torch.randn(5, 64)
    cos, sin = gather_cos_sin(rope.cos_sin_cache, positions)
    got = apply_rotary(query, key, cos, sin, head_size=64, rotary_dim=64, is_neox=False,
                       positions=positions, cos_sin_cache=rope.cos_sin_cache)
    want = rope.forward_native(positions, query.clone(), key.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_ops_rotary_rejects_bad_dims():
    cos = sin = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_reference(torch.zeros(2, 64), None, cos, sin, head_size=64, rotary_dim=80, is_neox=True)
    with pytest.raises(ValueError, match="cos has width"):
        apply_rotary_reference(torch.zeros(2, 64), None, cos, sin, head_size=64, rotary_dim=64, is_neox=True)
