"""matmul_all_reduce reference and dispatch on CPU; mc2_eligible rules; vs vLLM's RowParallelLinear."""

import pathlib

import pytest
import torch
import torch.nn.functional as F

from rollout_ext.ops import npu_available
from rollout_ext.ops.linear import matmul_all_reduce, mc2_eligible
from rollout_ext.testing.dist import run_ranks

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


class LocalGroup:
    """A one-process stand-in for a TP group at a given rank: all_reduce is the identity."""

    def __init__(self, rank_in_group: int = 0, world_size: int = 1):
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.device_group = None

    def all_reduce(self, tensor):
        return tensor


@pytest.mark.parametrize("fused", [False, True])
def test_ops_linear_bias_only_on_rank_zero(fused):
    assert not npu_available()
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(matmul_all_reduce(x, w, b, LocalGroup(0, 2), fused=fused), F.linear(x, w, b))
    assert torch.equal(matmul_all_reduce(x, w, b, LocalGroup(1, 2), fused=fused), F.linear(x, w))


@pytest.mark.parametrize(
    "dtype, x_shape, tp_size, min_tokens, quantized, expected",
    [
        (torch.bfloat16, (64, 32), 2, 64, False, True),
        (torch.float16, (2, 40, 32), 8, 64, False, True),  # 3-D: 80 tokens
        (torch.bfloat16, (2, 20, 32), 4, 64, False, False),  # 40 tokens < 64
        (torch.bfloat16, (64, 32), 2, 64, True, False),  # quantized
        (torch.float32, (64, 32), 2, 64, False, False),  # fp32 weights
        (torch.bfloat16, (64, 32), 3, 64, False, False),  # tp 3
        (torch.bfloat16, (64, 32), 16, 64, False, False),  # tp 16
        (torch.bfloat16, (64, 32), 1, 64, False, False),  # no TP
    ],
)
def test_ops_linear_mc2_eligible(dtype, x_shape, tp_size, min_tokens, quantized, expected):
    x = torch.zeros(x_shape, dtype=dtype)
    w = torch.zeros(16, 32, dtype=dtype)
    assert mc2_eligible(x, w, tp_size=tp_size, min_tokens=min_tokens, quantized=quantized) is expected


def test_ops_linear_mc2_rejects_mixed_dtypes():
    x = torch.zeros(64, 32, dtype=torch.float16)
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    assert not mc2_eligible(x, w, tp_size=2, min_tokens=1, quantized=False)


def test_ops_linear_matches_vllm_row_parallel_two_ranks():
    script = pathlib.Path(__file__).with_name("ops_scenarios") / "vllm_row_parallel.py"
    proc = run_ranks(script, REPO_ROOT, "rollout_ext_ops", timeout_s=110)
    output = proc.stdout
    assert proc.returncode == 0, output[-4000:]
    assert "rank 0: ok" in output and "rank 1: ok" in output
