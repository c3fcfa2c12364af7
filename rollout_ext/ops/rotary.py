"""Rotary position embedding (RoPE): vLLM's native math as the reference, torch_npu kernels on NPU.

`gather_cos_sin` is the per-step gather of cos/sin rows (done once per step by the rope_cache
patch). `apply_rotary` rotates query/key; its reference equals vLLM's
`RotaryEmbedding.forward_static` bit for bit (neox and GPT-J styles, partial rotary).

NPU paths, chosen only when torch_npu is importable:
- `torch_npu.npu_apply_rotary_pos_emb` (BSND layout, "half" mode) when the call is eligible:
  neox style, rotary_dim == head_size, head_size 64 or 128, key present.
- otherwise `torch_npu._npu_rotary_embedding` (an ATB op). That op keeps the FIRST cos_sin_cache
  table it ever sees in the process in static tensors (op-plugin RopeAtb.cpp) and ignores later
  tables. We therefore remember the first table we hand it and use the reference math for any
  other table, so several rope tables in one process stay correct.
Both NPU kernels may update query/key in place; always use the returned tensors.

Verification: the NPU paths are checked here only by binding each call against the real
torch_npu 2.14 schema and by an emulation of each op's documented math (tests/contract).
"""


import torch

from rollout_ext.ops import npu_available

FUSED_HEAD_SIZES = (64, 128)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ATB_DTYPES = (torch.float16, torch.bfloat16)  # ATB RopeOperation takes fp16/bf16 query/key only


def gather_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of vLLM's cos_sin_cache [max_pos, rotary_dim] for `positions`, split into
    cos and sin, each [T, rotary_dim // 2]."""
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    cos, sin = cos_sin.chunk(2, dim=-1)
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, H, rotary_dim]; cos/sin [T, rotary_dim // 2]. Same operation order as vLLM so that
    fp32 results match bit for bit."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        first, second = torch.chunk(x, 2, dim=-1)
    else:
        first, second = x[..., ::2], x[..., 1::2]
    out_first = first * cos - second * sin
    out_second = second * cos + first * sin
    if is_neox:
        return torch.cat((out_first, out_second), dim=-1)
    return torch.stack((out_first, out_second), dim=-1).flatten(-2)


def _rotate_heads(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
    is_neox: bool,
) -> torch.Tensor:
    shape = x.shape
    heads = x.reshape(cos.shape[0], -1, head_size)
    rotated = _rotate(heads[..., :rotary_dim], cos, sin, is_neox)
    return torch.cat((rotated, heads[..., rotary_dim:]), dim=-1).reshape(shape)


def _check_dims(cos: torch.Tensor, head_size: int, rotary_dim: int) -> None:
    if rotary_dim > head_size or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_size={head_size}")
    if cos.shape[-1] != rotary_dim // 2:
        raise ValueError(f"cos has width {cos.shape[-1]}, expected rotary_dim // 2 = {rotary_dim // 2}")


def apply_rotary_reference(
    query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
    head_size: int, rotary_dim: int, is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch RoPE on query [T, Hq*head_size] and key [T, Hk*head_size] (key may be None).
    Only the first rotary_dim of each head rotates. Returns new tensors."""
    _check_dims(cos, head_size, rotary_dim)
    query = _rotate_heads(query, cos, sin, head_size, rotary_dim, is_neox)
    if key is not None:
        key = _rotate_heads(key, cos, sin, head_size, rotary_dim, is_neox)
    return query, key


class _FirstTableTracker:
    """Remembers the first cos_sin_cache handed to the ATB rope op.

    Identity only, and no lock: on NPU this runs inside code that torch.compile traces whole
    (fullgraph), where neither a lock nor data_ptr() can be traced. The model forward runs on one
    thread. The strong reference keeps the first table alive, so it can never be mistaken for
    another."""

    def __init__(self) -> None:
        self._table: torch.Tensor | None = None

    def claim(self, table: torch.Tensor) -> bool:
        """True if `table` is the one the ATB op has (or will now have) cached."""
        if self._table is None:
            self._table = table
        return self._table is table


_ATB_ROPE_TABLE = _FirstTableTracker()


def fused_rope_eligible(
    query: torch.Tensor, key: torch.Tensor | None, *, head_size: int, rotary_dim: int,
    is_neox: bool,
) -> bool:
    """Whether npu_apply_rotary_pos_emb can take this call ("half" mode, head 64/128, full rotary)."""
    return (
        is_neox
        and key is not None
        and rotary_dim == head_size
        and head_size in FUSED_HEAD_SIZES
        and query.dtype in FUSED_DTYPES
        and key.dtype == query.dtype
    )


def _fused_rope(query, key, cos, sin, head_size):
    import torch_npu

    num_tokens = cos.shape[0]
    # BSND with B = tokens, S = 1; cos/sin broadcast over heads ([B, S, 1, D]).
    query_4d = query.reshape(num_tokens, 1, -1, head_size)
    key_4d = key.reshape(num_tokens, 1, -1, head_size)
    # "half" mode wants the full-width table: the same angles for both halves.
    cos_4d = torch.cat((cos, cos), dim=-1).to(query.dtype).reshape(num_tokens, 1, 1, head_size)
    sin_4d = torch.cat((sin, sin), dim=-1).to(query.dtype).reshape(num_tokens, 1, 1, head_size)
    query_4d, key_4d = torch_npu.npu_apply_rotary_pos_emb(
        query_4d, key_4d, cos_4d, sin_4d, layout="BSND", rotary_mode="half"
    )
    return query_4d.reshape(query.shape), key_4d.reshape(key.shape)


def _atb_rope(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox):
    import torch_npu

    num_tokens = positions.numel()
    # The ATB op wants contiguous 2-D [T, heads * width] tensors whose width is the rotated
    # width; its head_size argument is that width too (it sets the interleave coefficient).
    query_heads = query.reshape(num_tokens, -1, head_size)
    key_heads = key.reshape(num_tokens, -1, head_size)
    query_rot = query_heads[..., :rotary_dim].contiguous().view(num_tokens, -1)
    key_rot = key_heads[..., :rotary_dim].contiguous().view(num_tokens, -1)
    torch_npu._npu_rotary_embedding(
        positions.flatten(), query_rot, key_rot, rotary_dim, cos_sin_cache, is_neox
    )
    if rotary_dim == head_size:
        return query_rot.view(query.shape), key_rot.view(key.shape)
    query_out = torch.cat(
        (query_rot.view(num_tokens, -1, rotary_dim), query_heads[..., rotary_dim:]), dim=-1
    )
    key_out = torch.cat((key_rot.view(num_tokens, -1, rotary_dim), key_heads[..., rotary_dim:]), dim=-1)
    return query_out.reshape(query.shape), key_out.reshape(key.shape)


def apply_rotary_npu(
    query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
    head_size: int, rotary_dim: int, is_neox: bool, positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NPU RoPE: fused kernel when eligible, else the ATB op for the first table, else reference."""
    _check_dims(cos, head_size, rotary_dim)
    if fused_rope_eligible(query, key, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox):
        return _fused_rope(query, key, cos, sin, head_size)
    if (
        key is not None
        and query.dtype in ATB_DTYPES
        and key.dtype == query.dtype
        and positions is not None
        and cos_sin_cache is not None
        and cos_sin_cache.shape[-1] == rotary_dim
        and _ATB_ROPE_TABLE.claim(cos_sin_cache)
    ):
        return _atb_rope(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox)
    return apply_rotary_reference(
        query, key, cos, sin, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox
    )


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
    head_size: int, rotary_dim: int, is_neox: bool, positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE on query/key with cos/sin from `gather_cos_sin`. positions and cos_sin_cache are
    needed only by the ATB fallback on NPU. The NPU path may modify query/key in place."""
    if npu_available():
        return apply_rotary_npu(
            query, key, cos, sin, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox,
            positions=positions, cos_sin_cache=cos_sin_cache,
        )
    return apply_rotary_reference(
        query, key, cos, sin, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox
    )


def apply_rotary_step_reference(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE over the whole head from full-width per-step tables: cos/sin [1, T, 1, head_size]
    with each angle in both halves (the layout vllm-ascend's `update_cos_sin` fills)."""
    num_tokens = query.shape[0]
    cos_t, sin_t = cos[0].to(query.dtype), sin[0].to(query.dtype)  # [T, 1, D], broadcast over heads
    out = []
    for x in (query, key):
        heads = x.reshape(num_tokens, -1, head_size)
        first, second = heads.chunk(2, dim=-1)
        out.append((heads * cos_t + torch.cat((-second, first), dim=-1) * sin_t).reshape(x.shape))
    return out[0], out[1]


def apply_rotary_step_npu(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with one aclnn kernel: npu_apply_rotary_pos_emb, BSND with B=1, S=tokens."""
    import torch_npu

    num_tokens = query.shape[0]
    query_4d = query.contiguous().view(1, num_tokens, -1, head_size)
    key_4d = key.contiguous().view(1, num_tokens, -1, head_size)
    query_4d, key_4d = torch_npu.npu_apply_rotary_pos_emb(
        query_4d, key_4d, cos, sin, layout="BSND", rotary_mode="half"
    )
    return query_4d.view(query.shape), key_4d.view(key.shape)
