"""Prefill attention NPU path under the torch_npu emulation, compared with the reference path."""

import torch

import torch_npu
from rollout_ext.ops.attention import (
    causal_mask,
    prefill_attention,
    prefill_attention_reference,
)

SEQ_LENS = [3, 7, 1, 5]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 2, 16


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(SEQ_LENS)
    q = torch.randn(tokens, NUM_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dtype)
    return q, k, v


def kwargs():
    return dict(seq_lens=SEQ_LENS, scale=HEAD_SIZE**-0.5, num_heads=NUM_HEADS,
                num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE)


def main():
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = inputs(dtype)
        before = len(torch_npu.CALLS)
        out = prefill_attention(q, k, v, **kwargs())
        calls = torch_npu.CALLS[before:]
        assert [op for op, _ in calls] == ["_npu_flash_attention_v2"], calls
        bound = calls[0][1]
        assert bound["mask_type"] == 1, f"mask_type {bound['mask_type']} (default 2 is ALiBi)"
        assert bound["seq_len"] == SEQ_LENS and isinstance(bound["seq_len"], list)
        assert out.shape == q.shape and out.dtype == dtype
        ref = prefill_attention_reference(q, k, v, **kwargs())
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
        print(f"ok {dtype}: NPU path == reference, mask_type=1, host seq_len")

    # Controls: the emulation rejects the op's ALiBi default and a wrongly encoded bf16 mask.
    q, k, v = inputs(torch.bfloat16)
    heads = lambda t, n: t.view(t.shape[0], n, HEAD_SIZE)
    qh, kh, vh = heads(q, NUM_HEADS), heads(k, NUM_KV_HEADS), heads(v, NUM_KV_HEADS)
    common = dict(scale_value=HEAD_SIZE**-0.5, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS)
    try:
        torch_npu.atb._npu_flash_attention_v2(qh, kh, vh, SEQ_LENS, out=torch.empty_like(qh), **common)
        raise AssertionError("default mask_type was accepted")
    except NotImplementedError:
        pass
    fp16_encoded = causal_mask(max(SEQ_LENS), torch.float16, "cpu").to(torch.bfloat16)
    wrong = torch_npu.atb._npu_flash_attention_v2(
        qh, kh, vh, SEQ_LENS, mask=fp16_encoded, mask_type=1, out=torch.empty_like(qh), **common)
    ref = prefill_attention_reference(q, k, v, **kwargs())
    assert not torch.allclose(wrong.reshape(q.shape).float(), ref.float(), atol=1e-2), "mask encoding unchecked"
    try:
        torch_npu.atb._npu_flash_attention_v2(
            qh, kh, vh, torch.tensor(SEQ_LENS), mask=fp16_encoded, mask_type=1,
            out=torch.empty_like(qh), **common)
        raise AssertionError("a tensor seq_len was accepted")
    except TypeError:
        pass
    print("ok controls: ALiBi default refused, fp16 mask encoding wrong for bf16, tensor seq_len refused")


if __name__ == "__main__":
    main()
