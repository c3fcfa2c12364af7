"""flashcomm: applies idempotently, reverts exactly, its guards trip, padding math, and the
token-sharded layer path on 2 real CPU ranks equals vLLM's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version

from rollout_ext.config import ExtConfig
from rollout_ext.patches import PatchError
from rollout_ext.patches import flashcomm
from rollout_ext.testing.dist import run_ranks

import vllm.model_executor.layers.linear as vllm_linear  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.models.llama import LlamaModel  # noqa: E402
from vllm.model_executor.models.qwen2 import Qwen2Model  # noqa: E402

CFG = ExtConfig(flashcomm=True, flashcomm_min_tokens=1)
COLUMN, ROW = vllm_linear.ColumnParallelLinear, vllm_linear.RowParallelLinear


def swapped_attributes():
    return [
        (Qwen2Model, "__call__"), (Qwen2Model, "embed_input_ids"),
        (LlamaModel, "__call__"), (LlamaModel, "embed_input_ids"),
        (COLUMN, "forward"), (ROW, "forward"), (VllmConfig, "compute_hash"),
    ]


def snapshot():
    return [owner.__dict__.get(attr) for owner, attr in swapped_attributes()]


@pytest.fixture
def reverted():
    yield
    flashcomm.revert()


def test_apply_is_idempotent_and_revert_restores_originals(reverted):
    originals = snapshot()
    flashcomm.apply(CFG)
    patched = snapshot()
    assert all(p is not o for p, o in zip(patched, originals))
    flashcomm.apply(CFG)
    assert all(a is b for a, b in zip(snapshot(), patched))
    flashcomm.revert()
    assert all(a is b for a, b in zip(snapshot(), originals))
    flashcomm.revert()
    assert all(a is b for a, b in zip(snapshot(), originals))


def test_version_guard_names_the_patch(monkeypatch, reverted):
    originals = snapshot()
    monkeypatch.setattr("rollout_ext.patches._base.vllm_version", lambda: Version("0.22.0"))
    with pytest.raises(PatchError, match="flashcomm"):
        flashcomm.apply(CFG)
    assert all(a is b for a, b in zip(snapshot(), originals))


def test_signature_guard_trips_when_upstream_moved():
    class MovedRow(ROW):
        def forward(self, x, residual):
            return x

    class MovedModel(Qwen2Model):
        def forward(self, positions, input_ids):
            return input_ids

    with pytest.raises(PatchError, match="flashcomm.*forward"):
        flashcomm.check_upstream([Qwen2Model], COLUMN, MovedRow)
    with pytest.raises(PatchError, match="flashcomm.*forward"):
        flashcomm.check_upstream([MovedModel], COLUMN, ROW)
    flashcomm.check_upstream([Qwen2Model, LlamaModel], COLUMN, ROW)


def test_a_model_without_compile_wrapper_is_refused():
    class Uncompiled(torch.nn.Module):
        forward = Qwen2Model.forward
        embed_input_ids = Qwen2Model.embed_input_ids

    with pytest.raises(PatchError, match="flashcomm.*compile wrapper"):
        flashcomm.check_upstream([Uncompiled], COLUMN, ROW)


@given(tokens=st.integers(1, 300), tp=st.sampled_from([2, 4, 8]))
def test_padding_holds_every_token_with_less_than_one_row_per_rank_spare(tokens, tp):
    rows = flashcomm.padded_rows(tokens, tp)
    assert rows % tp == 0 and tokens <= rows < tokens + tp
    x = torch.randn(tokens, 3)
    padded = flashcomm.pad_rows(x, rows)
    assert padded.shape == (rows, 3)
    assert torch.equal(padded[:tokens], x) and not padded[tokens:].any()


def test_sharded_layers_on_two_ranks_equal_vllm(repo_root):
    script = repo_root / "tests/unit/patch_scenarios/flashcomm_layers.py"
    proc = run_ranks(script, repo_root, "flashcomm-unit", timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout
