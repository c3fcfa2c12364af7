"""Emulated torch_npu.atb ops (ATB library via op-plugin)."""

import torch

from torch_npu._schema import bind

MASK_TYPE_UNDEFINED = 0
MASK_TYPE_NORM = 1


def _npu_flash_attention_v2(*args, **kwargs):
    """ATB SelfAttention, PA_ENCODER, packed [T, N, D] inputs, written into `out`.

    Mask encoding follows op-plugin's golden for this op: fp16 masks are added to the scaled
    scores; for bf16 the kernel multiplies the mask by -3e38 before adding. mask_type 0 (no mask)
    and 1 (NORM, one [max_seq_len, max_seq_len] mask for all sequences) are modelled; the default
    2 is ALiBi and is refused here, as are the compressed variants."""
    a = bind("_npu_flash_attention_v2", args, kwargs)
    query, key, value, out = a["query"], a["key"], a["value"], a["out"]
    seq_len, mask, mask_type = a["seq_len"], a["mask"], a["mask_type"]
    if mask_type not in (MASK_TYPE_UNDEFINED, MASK_TYPE_NORM):
        raise NotImplementedError(f"_npu_flash_attention_v2: mask_type={mask_type} (2 is ALiBi) is not modelled")
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError(f"_npu_flash_attention_v2: {name} must be contiguous 3-D [T, N, D]")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"_npu_flash_attention_v2: {name} must be fp16 or bf16")
    num_heads, num_kv_heads = a["num_heads"], a["num_kv_heads"]
    if num_heads <= 0 or query.shape[1] != num_heads:
        raise ValueError(f"_npu_flash_attention_v2: num_heads={num_heads} vs query {tuple(query.shape)}")
    kv_heads = num_kv_heads if num_kv_heads > 0 else num_heads
    if key.shape[1] != kv_heads or value.shape[1] != kv_heads or num_heads % kv_heads:
        raise ValueError(f"_npu_flash_attention_v2: num_kv_heads={num_kv_heads} vs key {tuple(key.shape)}")
    if sum(seq_len) != query.shape[0] or key.shape[0] != query.shape[0]:
        raise ValueError(f"_npu_flash_attention_v2: seq_len {seq_len} does not cover {query.shape[0]} tokens")
    if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
        raise ValueError("_npu_flash_attention_v2: out must match query's shape and dtype")
    max_len = max(seq_len)
    if mask_type == MASK_TYPE_NORM:
        if mask is None or tuple(mask.shape) != (max_len, max_len) or mask.dtype != query.dtype:
            raise ValueError(f"_npu_flash_attention_v2: NORM mask must be [{max_len}, {max_len}] in query's dtype")
        mask_coeff = 1.0 if query.dtype == torch.float16 else -3e38
    group = num_heads // kv_heads
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    start = 0
    for length in seq_len:
        end = start + length
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * a["scale_value"]
        if mask_type == MASK_TYPE_NORM:
            scores = scores + mask[:length, :length].float() * mask_coeff
        probs = scores.softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v[start:end]).to(out.dtype)
        start = end
    return out
