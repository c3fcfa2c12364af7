"""Rotary NPU paths under the torch_npu emulation, compared with the reference path.

Usage: rotary_scenario.py CASE. Each case is one process, because the ATB rope op keeps the
first table it sees for the life of the process."""

import sys

import torch

import torch_npu
from rollout_ext.ops import npu_available
from rollout_ext.ops.rotary import apply_rotary, apply_rotary_reference, gather_cos_sin


HALF = torch.float16


def rope_table(rotary_dim: int, base: float, max_pos: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def op_calls(name: str) -> int:
    return sum(1 for op, _ in torch_npu.CALLS if op == name)


def check(*, head_size, rotary_dim, is_neox, table, expect_op, dtype=torch.float32, with_key=True,
          num_tokens=11, q_heads=4, k_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, table.shape[0], (num_tokens,), generator=gen)
    query = torch.randn(num_tokens, q_heads * head_size, generator=gen).to(dtype)
    key = torch.randn(num_tokens, k_heads * head_size, generator=gen).to(dtype) if with_key else None
    cos, sin = gather_cos_sin(table, positions)
    ref_q, ref_k = apply_rotary_reference(
        query.clone(), None if key is None else key.clone(), cos, sin,
        head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox,
    )
    before = {name: op_calls(name) for name in ("npu_apply_rotary_pos_emb", "_npu_rotary_embedding")}
    out_q, out_k = apply_rotary(
        query.clone(), None if key is None else key.clone(), cos, sin, head_size=head_size,
        rotary_dim=rotary_dim, is_neox=is_neox, positions=positions, cos_sin_cache=table,
    )
    taken = [name for name, n in before.items() if op_calls(name) > n]
    assert taken == ([expect_op] if expect_op else []), f"expected {expect_op}, ops called: {taken}"
    # fp32 must match bit for bit; half precision within one rounding step of the reference.
    same = torch.equal if dtype == torch.float32 else (
        lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2))
    assert same(out_q, ref_q), f"query differs: max {(out_q.float() - ref_q.float()).abs().max()}"
    assert (out_k is None and ref_k is None) or same(out_k, ref_k), "key differs"
    print(f"ok head={head_size} rot={rotary_dim} neox={is_neox} {dtype} via {expect_op or 'reference'}")


def case_fused_then_two_tables():
    table_a = rope_table(128, 10000.0)
    table_64 = rope_table(64, 10000.0)
    check(head_size=128, rotary_dim=128, is_neox=True, table=table_a, expect_op="npu_apply_rotary_pos_emb")
    check(head_size=64, rotary_dim=64, is_neox=True, table=table_64, expect_op="npu_apply_rotary_pos_emb")
    check(head_size=128, rotary_dim=128, is_neox=True, table=table_a, dtype=torch.bfloat16,
          expect_op="npu_apply_rotary_pos_emb")
    # GPT-J style is not eligible for the fused op: the ATB op takes the first table it sees.
    # fp32 is outside the ATB op's dtypes: reference math, no op call.
    check(head_size=128, rotary_dim=128, is_neox=False, table=table_a, expect_op=None)
    check(head_size=128, rotary_dim=128, is_neox=False, table=table_a, dtype=HALF,
          expect_op="_npu_rotary_embedding")
    table_b = rope_table(128, 500000.0)
    # A second, distinct table must not reach the ATB op (it would silently use table_a).
    check(head_size=128, rotary_dim=128, is_neox=False, table=table_b, dtype=HALF, expect_op=None, seed=1)
    check(head_size=128, rotary_dim=128, is_neox=False, table=table_a, dtype=HALF,
          expect_op="_npu_rotary_embedding", seed=2)
    # Control: the emulation really models the quirk, so the check above can fail.
    positions = torch.arange(5)
    query, key = torch.randn(5, 128).to(HALF), torch.randn(5, 128).to(HALF)
    direct_q, direct_k = query.clone(), key.clone()
    torch_npu._npu_rotary_embedding(positions, direct_q, direct_k, 128, table_b, False)
    cos_b, sin_b = gather_cos_sin(table_b, positions)
    ref_q, _ = apply_rotary_reference(query, key, cos_b, sin_b, head_size=128, rotary_dim=128, is_neox=False)
    assert not torch.allclose(direct_q, ref_q), "emulation did not keep the first table"
    print("ok quirk control: ATB op called with a second table returns first-table results")


def case_neox_head80():
    check(head_size=80, rotary_dim=80, is_neox=True, table=rope_table(80, 10000.0), dtype=HALF,
          expect_op="_npu_rotary_embedding")


def case_neox_partial():
    check(head_size=128, rotary_dim=64, is_neox=True, table=rope_table(64, 10000.0), dtype=HALF,
          expect_op="_npu_rotary_embedding")


def case_gptj_partial():
    table = rope_table(32, 10000.0)
    check(head_size=128, rotary_dim=32, is_neox=False, table=table, dtype=torch.bfloat16,
          expect_op="_npu_rotary_embedding")
    check(head_size=128, rotary_dim=32, is_neox=False, table=table, dtype=torch.bfloat16,
          expect_op=None, with_key=False)


if __name__ == "__main__":
    assert npu_available(), "emulated torch_npu not importable"
    globals()[f"case_{sys.argv[1]}"]()
