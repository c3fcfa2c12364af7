"""Causal prefill attention over packed sequences (TND layout), with grouped-query heads.

`prefill_attention` takes query [T, Hq*D] (or [T, Hq, D]), key/value [T, Hk*D] (or 3-D) where T
is the sum of `seq_lens`, and returns attention output in query's shape. Each sequence attends
causally to itself only. Query head h reads kv head h // (Hq // Hk), as in vLLM.

NPU path: `torch_npu.atb._npu_flash_attention_v2` (ATB SelfAttention, PA_ENCODER). Two traps:
- its default mask_type=2 is ALiBi; we pass mask_type=1 (plain causal mask) explicitly;
- seq_len must be a HOST list of ints, never a device tensor.
The mask encoding depends on dtype, per op-plugin's own golden for this op: fp16 masks are added
to the scores (we use -10000 at masked spots); for bf16 the kernel multiplies the mask by -3e38,
so masked spots hold 1.

`fav2_supported()` says whether the NPU path exists; callers that need it refuse elsewhere with
`require_fav2`. Verification: the NPU call is checked here only against the real schema (from
op-plugin) and an emulation of the documented math (tests/contract).
"""

import torch

from rollout_ext.ops import npu_available

FP16_MASKED_VALUE = -10000.0


def fav2_supported() -> bool:
    """True when torch_npu (and so the ATB flash-attention op) can be used."""
    return npu_available()


def require_fav2(feature: str) -> None:
    """Raise a clear error when `feature` needs the NPU flash-attention op and it is absent."""
    if not fav2_supported():
        raise RuntimeError(
            f"{feature} needs torch_npu.atb._npu_flash_attention_v2, which exists only on Ascend "
            "NPUs with torch_npu installed; disable it on this device."
        )


def _as_heads(t: torch.Tensor, num_heads: int, head_size: int) -> torch.Tensor:
    return t.reshape(t.shape[0], num_heads, head_size)


def _host_seq_lens(seq_lens, num_tokens: int) -> list[int]:
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if any(n <= 0 for n in lens) or sum(lens) != num_tokens:
        raise ValueError(f"seq_lens {lens} must be positive and sum to num_tokens={num_tokens}")
    return lens


def prefill_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, seq_lens, scale: float,
    num_heads: int, num_kv_heads: int, head_size: int,
) -> torch.Tensor:
    """Pure-torch causal attention per packed sequence, computed in fp32."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    lens = _host_seq_lens(seq_lens, query.shape[0])
    group_size = num_heads // num_kv_heads
    q = _as_heads(query, num_heads, head_size).float()
    k = _as_heads(key, num_kv_heads, head_size).float().repeat_interleave(group_size, dim=1)
    v = _as_heads(value, num_kv_heads, head_size).float().repeat_interleave(group_size, dim=1)
    outputs = []
    start = 0
    for length in lens:
        end = start + length
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v[start:end]))
        start = end
    return torch.cat(outputs).to(query.dtype).reshape(query.shape)


def causal_mask(max_seq_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_seq_len, max_seq_len] causal mask in the encoding the ATB op expects for `dtype`."""
    masked = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device).triu(1)
    masked_value = FP16_MASKED_VALUE if dtype == torch.float16 else 1.0
    return torch.zeros(max_seq_len, max_seq_len, dtype=dtype, device=device).masked_fill(
        masked, masked_value
    )


def prefill_attention_npu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, seq_lens, scale: float,
    num_heads: int, num_kv_heads: int, head_size: int,
) -> torch.Tensor:
    """ATB flash attention (PA_ENCODER) with an explicit causal mask."""
    import torch_npu

    lens = _host_seq_lens(seq_lens, query.shape[0])
    # ATB rejects non-contiguous tensors.
    q = _as_heads(query, num_heads, head_size).contiguous()
    k = _as_heads(key, num_kv_heads, head_size).contiguous()
    v = _as_heads(value, num_kv_heads, head_size).contiguous()
    out = torch.empty_like(q)
    torch_npu.atb._npu_flash_attention_v2(
        q, k, v, lens,
        mask=causal_mask(max(lens), q.dtype, q.device),
        mask_type=1,
        scale_value=float(scale),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        out=out,
    )
    return out.reshape(query.shape)


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, seq_lens: list[int],
    scale: float, num_heads: int, num_kv_heads: int, head_size: int,
) -> torch.Tensor:
    """Causal attention over packed sequences: the ATB kernel on NPU, the reference elsewhere."""
    impl = prefill_attention_npu if fav2_supported() else prefill_attention_reference
    return impl(
        query, key, value, seq_lens=seq_lens, scale=scale, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_size=head_size,
    )
