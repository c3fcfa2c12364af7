"""Row-parallel matmul followed by the tensor-parallel all-reduce, optionally as one NPU kernel.

Contract: `matmul_all_reduce(x, weight, bias, group)` == all_reduce(F.linear(x, weight,
bias if rank == 0 else None)) over the tensor-parallel group. The bias goes in on rank 0 only
because the reduction sums it.

`group` is duck-typed like vLLM's GroupCoordinator: `.all_reduce(t)`, `.device_group` (a torch
ProcessGroup), `.rank_in_group`, `.world_size`.

NPU path (fused=True and torch_npu importable): `torch_npu.npu_mm_all_reduce_base` (MC2), which
overlaps the matmul with the HCCL all-reduce. It needs the HCCL communicator name of the group;
that name is resolved once per process group (never one global) by `hccl_comm_name`.

Verification: the fused path is checked here only against the real torch_npu 2.14 schema and an
emulation of the op's documented math over a gloo group. `hccl_comm_name` runs against an
emulated HCCL backend registered through torch's public backend registry; the real HCCL lookup
is verified only by that emulation.
"""

import threading

import torch
import torch.nn.functional as F

from rollout_ext.ops import npu_available

MC2_TP_SIZES = (2, 4, 8)
MC2_DTYPES = (torch.float16, torch.bfloat16)


def matmul_all_reduce_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group
) -> torch.Tensor:
    """F.linear with the bias on rank 0 only, then the group's all-reduce."""
    rank_bias = bias if group.rank_in_group == 0 else None
    return group.all_reduce(F.linear(x, weight, rank_bias))


def hccl_comm_name(device_group) -> str:
    """The HCCL communicator name of `device_group`, as npu_mm_all_reduce_base's `hcom` wants.

    torch_npu documents the lookup as `pg._get_backend(torch.device("npu")).get_hccl_comm_name(rank)`
    with the GLOBAL rank of this process. Verified only by emulation (no HCCL here)."""
    import torch_npu  # noqa: F401  (registers the "npu" device and the HCCL backend)

    backend = device_group._get_backend(torch.device("npu"))
    return backend.get_hccl_comm_name(torch.distributed.get_rank())


_HCOM_BY_GROUP: dict = {}
_HCOM_LOCK = threading.Lock()


def hcom_for_group(device_group) -> str:
    """Cached `hccl_comm_name`, keyed by the process group object itself."""
    with _HCOM_LOCK:
        name = _HCOM_BY_GROUP.get(device_group)
        if name is None:
            name = hccl_comm_name(device_group)
            _HCOM_BY_GROUP[device_group] = name
        return name


def mc2_eligible(
    x: torch.Tensor, weight: torch.Tensor, *, tp_size: int, min_tokens: int, quantized: bool
) -> bool:
    """Whether the fused MC2 kernel should take this matmul.

    Only unquantized fp16/bf16 weights (x of the same dtype), TP size 2/4/8, and at least
    `min_tokens` tokens: the op's docs aim it at full prefill, not incremental decode.
    x may be 2-D [T, K] or 3-D [B, S, K]; tokens are all leading dims together."""
    if quantized or tp_size not in MC2_TP_SIZES:
        return False
    if weight.dim() != 2 or weight.dtype not in MC2_DTYPES or x.dtype != weight.dtype:
        return False
    if x.dim() not in (2, 3) or x.shape[-1] != weight.shape[1]:
        return False
    num_tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return num_tokens >= min_tokens


def matmul_all_reduce_npu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group
) -> torch.Tensor:
    """One MC2 kernel: matmul with the reduction fused in. Bias on TP rank 0 only."""
    import torch_npu

    hcom = hcom_for_group(group.device_group)
    rank_bias = bias if group.rank_in_group == 0 else None
    return torch_npu.npu_mm_all_reduce_base(x, weight.t(), hcom, reduce_op="sum", bias=rank_bias)


def matmul_all_reduce(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, *, fused: bool
) -> torch.Tensor:
    """all_reduce(F.linear(x, weight, bias on rank 0)). With fused=True the NPU kernel is used
    when torch_npu is importable and the group has more than one rank; otherwise the reference."""
    if fused and group.world_size > 1 and npu_available():
        return matmul_all_reduce_npu(x, weight, bias, group)
    return matmul_all_reduce_reference(x, weight, bias, group)
