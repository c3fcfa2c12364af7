"""prefill_attention reference on CPU: per-sequence causal SDPA, GQA head mapping, dispatch."""

import pytest
import torch
import torch.nn.functional as F

from rollout_ext.ops.attention import (
    causal_mask,
    fav2_supported,
    prefill_attention,
    prefill_attention_reference,
    require_fav2,
)


def sdpa_per_sequence(q, k, v, seq_lens, scale, num_heads, num_kv_heads, head_size):
    """Independent check: torch SDPA per sequence, kv heads expanded the vLLM way."""
    group = num_heads // num_kv_heads
    out, start = [], 0
    for n in seq_lens:
        qs = q[start:start + n].view(n, num_heads, head_size).transpose(0, 1)
        ks = k[start:start + n].view(n, num_kv_heads, head_size).repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start:start + n].view(n, num_kv_heads, head_size).repeat_interleave(group, 1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out.append(o.transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_ops_attention_reference_matches_sdpa(num_heads, num_kv_heads):
    seq_lens, head_size = [5, 1, 9, 3], 16
    gen = torch.Generator().manual_seed(num_heads)
    tokens = sum(seq_lens)
    q = torch.randn(tokens, num_heads * head_size, generator=gen)
    k = torch.randn(tokens, num_kv_heads * head_size, generator=gen)
    v = torch.randn(tokens, num_kv_heads * head_size, generator=gen)
    kwargs = dict(seq_lens=seq_lens, scale=0.25, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_size=head_size)
    got = prefill_attention_reference(q, k, v, **kwargs)
    want = sdpa_per_sequence(q, k, v, seq_lens, 0.25, num_heads, num_kv_heads, head_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # 3-D inputs give the same numbers in query's 3-D shape.
    got_3d = prefill_attention_reference(
        q.view(tokens, num_heads, head_size), k.view(tokens, num_kv_heads, head_size),
        v.view(tokens, num_kv_heads, head_size), **kwargs)
    assert got_3d.shape == (tokens, num_heads, head_size)
    torch.testing.assert_close(got_3d.reshape(tokens, -1), got)


def test_ops_attention_sequences_do_not_see_each_other():
    q = torch.randn(6, 8)
    k, v = torch.randn(6, 8), torch.randn(6, 8)
    kwargs = dict(seq_lens=[2, 4], scale=1.0, num_heads=1, num_kv_heads=1, head_size=8)
    base = prefill_attention_reference(q, k, v, **kwargs)
    v2 = v.clone()
    v2[:2] += 100.0  # change only the first sequence
    changed = prefill_attention_reference(q, k, v2, **kwargs)
    assert torch.equal(changed[2:], base[2:]) and not torch.equal(changed[:2], base[:2])


def test_ops_attention_cpu_dispatch_and_refusal():
    assert not fav2_supported()
    q = torch.randn(3, 8)
    kwargs = dict(seq_lens=[3], scale=1.0, num_heads=1, num_kv_heads=1, head_size=8)
    assert torch.equal(prefill_attention(q, q, q, **kwargs), prefill_attention_reference(q, q, q, **kwargs))
    with pytest.raises(RuntimeError, match="fav2_attention needs torch_npu"):
        require_fav2("fav2_attention")


def test_ops_attention_rejects_bad_seq_lens():
    q = torch.randn(3, 8)
    with pytest.raises(ValueError, match="sum to num_tokens"):
        prefill_attention_reference(q, q, q, seq_lens=[2], scale=1.0, num_heads=1, num_kv_heads=1, head_size=8)


def test_ops_attention_causal_mask_encoding():
    fp16 = causal_mask(3, torch.float16, "cpu")
    bf16 = causal_mask(3, torch.bfloat16, "cpu")
    assert fp16[0, 1] == -10000.0 and fp16[1, 0] == 0 and fp16[2, 2] == 0
    assert bf16[0, 2] == 1.0 and bf16[2, 0] == 0 and bf16.is_contiguous()
