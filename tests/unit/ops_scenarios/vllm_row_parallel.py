"""Two CPU ranks under vLLM's real distributed state: our matmul_all_reduce (reference path and
fused=True, which falls back on CPU) equals vLLM's RowParallelLinear, using vLLM's real
GroupCoordinator as the group."""

import sys

import torch
import torch.multiprocessing as mp

from rollout_ext.testing.dist import vllm_tp_group

WORLD_SIZE = 2


def worker(rank: int, port: int) -> None:
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.linear import RowParallelLinear

    from rollout_ext.ops.linear import matmul_all_reduce

    with vllm_tp_group(rank, port, WORLD_SIZE):
        gen = torch.Generator().manual_seed(0)
        in_features, out_features, tokens = 32, 24, 5
        x_full = torch.randn(tokens, in_features, generator=gen)
        w_full = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        layer = RowParallelLinear(in_features, out_features, bias=True, input_is_parallel=True,
                                  params_dtype=torch.float32)
        shard = slice(rank * in_features // WORLD_SIZE, (rank + 1) * in_features // WORLD_SIZE)
        w = w_full[:, shard].contiguous()
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(bias)
        layer.quant_method.process_weights_after_loading(layer)
        x = x_full[:, shard].contiguous()
        expected, _ = layer(x)
        group = parallel_state.get_tp_group()
        for fused in (False, True):
            # Our own copies: the CPU weight post-processing may repack layer.weight.
            ours = matmul_all_reduce(x, w, bias, group, fused=fused)
            # vLLM's CPU gemm may use another kernel (oneDNN): equal up to fp32 rounding.
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        print(f"rank {rank}: ok")


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=WORLD_SIZE, join=True)
