"""Fused matmul+all-reduce under the torch_npu emulation: 2 ranks over gloo, two TP groups.

Checks, on every rank: the fused path calls npu_mm_all_reduce_base with the bias on rank 0 only,
resolves hcom per process group (two groups -> two names, each reaching its own communicator),
and equals both the reference path and the unsharded F.linear."""

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import torch_npu  # registers the "npu" device and the emulated "hccl" backend, as the real one does
from rollout_ext.ops.linear import hcom_for_group, matmul_all_reduce, matmul_all_reduce_reference

WORLD_SIZE = 2
DTYPE = torch.bfloat16


class TpGroup:
    """Duck-typed like vLLM's GroupCoordinator."""

    def __init__(self, ranks: list[int]):
        self.device_group = dist.new_group(ranks, backend="cpu:gloo,npu:hccl")
        self.rank_in_group = ranks.index(dist.get_rank())
        self.world_size = len(ranks)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.device_group)
        return tensor


def mm_calls():
    return [args for op, args in torch_npu.CALLS if op == "npu_mm_all_reduce_base"]


def worker(rank: int, port: int) -> None:
    dist.init_process_group("cpu:gloo,npu:hccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD_SIZE)
    try:
        group_a, group_b = TpGroup([0, 1]), TpGroup([0, 1])
        gen = torch.Generator().manual_seed(0)
        tokens, in_features, out_features = 6, 32, 24
        x_full = torch.randn(tokens, in_features, generator=gen).to(DTYPE)
        w_full = torch.randn(out_features, in_features, generator=gen).to(DTYPE)
        bias = torch.randn(out_features, generator=gen).to(DTYPE)
        shard = slice(rank * in_features // WORLD_SIZE, (rank + 1) * in_features // WORLD_SIZE)
        x, w = x_full[:, shard].contiguous(), w_full[:, shard].contiguous()
        expected = F.linear(x_full.float(), w_full.float(), bias.float())

        for group in (group_a, group_b, group_a):
            fused = matmul_all_reduce(x, w, bias, group, fused=True)
            reference = matmul_all_reduce_reference(x, w, bias, group)
            torch.testing.assert_close(fused, reference, rtol=2e-2, atol=5e-2)
            torch.testing.assert_close(fused.float(), expected, rtol=2e-2, atol=1e-1)
        # 3-D input goes through the same op.
        fused_3d = matmul_all_reduce(x.view(2, 3, -1), w, bias, group_a, fused=True)
        torch.testing.assert_close(fused_3d.view(tokens, -1).float(), expected, rtol=2e-2, atol=1e-1)

        calls = mm_calls()
        assert len(calls) == 4, f"expected 4 fused calls, got {len(calls)}"
        for call in calls:
            assert (call["bias"] is not None) == (rank == 0), f"rank {rank} bias rule broken"
            assert call["reduce_op"] == "sum"
        hcom_a, hcom_b = hcom_for_group(group_a.device_group), hcom_for_group(group_b.device_group)
        assert hcom_a != hcom_b, "two groups share one hcom"
        assert [c["hcom"] for c in calls] == [hcom_a, hcom_b, hcom_a, hcom_a]
        assert torch_npu.HCCL_COMMS[hcom_a] is group_a.device_group._get_backend(torch.device("npu"))
        # fused=False never touches the NPU op.
        matmul_all_reduce(x, w, bias, group_a, fused=False)
        assert len(mm_calls()) == 4
        print(f"rank {rank}: ok, hcom per group {hcom_a} / {hcom_b}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29513
    mp.spawn(worker, args=(port,), nprocs=WORLD_SIZE, join=True)
