"""Two CPU ranks under vLLM's real distributed state, with the mc2_row_parallel patch applied.

Checks on every rank:
- new RowParallelLinear layers are the patch's subclass, and revert() brings vLLM's class back;
- fp32 (not eligible): the output is bit-identical to vLLM's own RowParallelLinear.forward;
- bf16 under torch.compile(dynamic=True): one graph serves 3, 8 and 2 tokens (no recompile), while
  the fused branch is taken only for 8 >= min_tokens=4, i.e. decided at run time inside the op;
  results equal the unsharded F.linear.
"""

import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from rollout_ext.testing.dist import vllm_tp_group

WORLD_SIZE = 2
MIN_TOKENS = 4


def build(rank, in_features, out_features, dtype, gen, keep_weight):
    from vllm.model_executor.layers.linear import RowParallelLinear

    w_full = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    layer = RowParallelLinear(in_features, out_features, bias=True, params_dtype=dtype,
                              prefix=f"test.{dtype}.o_proj")
    shard = slice(rank * in_features // WORLD_SIZE, (rank + 1) * in_features // WORLD_SIZE)
    layer.weight.data.copy_(w_full[:, shard])
    layer.bias.data.copy_(bias)
    weight = layer.weight
    layer.quant_method.process_weights_after_loading(layer)
    if keep_weight:
        # vLLM's CPU backend drops the unpacked weight; MC2 (like the NPU backend) needs it.
        layer.weight = weight
    return layer, w_full, bias, shard


def worker(rank: int, port: int) -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear

    from rollout_ext.config import ExtConfig
    from rollout_ext.patches import mc2_row_parallel as mc2

    with vllm_tp_group(rank, port, WORLD_SIZE):
        try:
            mc2.apply(ExtConfig(mc2=True, mc2_min_tokens=MIN_TOKENS))
            gen = torch.Generator().manual_seed(0)

            layer, w_full, bias, shard = build(rank, 32, 24, torch.float32, gen, keep_weight=False)
            assert type(layer).__name__ == "Mc2RowParallelLinear", type(layer)
            x = torch.randn(9, 32, generator=gen)[:, shard].contiguous()
            ours, _ = layer(x)
            theirs, _ = RowParallelLinear.forward(layer, x)
            assert torch.equal(ours, theirs), (ours - theirs).abs().max()
            assert mc2.COUNTERS.read() == {"calls": 1, "fused": 0}, mc2.COUNTERS.read()

            mc2.COUNTERS.reset()
            layer, w_full, bias, shard = build(rank, 64, 48, torch.bfloat16, gen, keep_weight=True)
            compiled = torch.compile(layer, dynamic=True, backend="aot_eager", fullgraph=True)
            fused_after = []
            for step, tokens in enumerate((3, 8, 2)):
                x_full = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
                out, _ = compiled(x_full[:, shard].contiguous())
                expected = F.linear(x_full.float(), w_full.float(), bias.float())
                torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=1e-1)
                fused_after.append(mc2.COUNTERS.read()["fused"])
                if step == 0:
                    torch.compiler.set_stance("fail_on_recompile")
            assert fused_after == [0, 1, 1], fused_after
            assert mc2.COUNTERS.read()["calls"] == 3, mc2.COUNTERS.read()

            mc2.revert()
            plain = RowParallelLinear(8, 8, bias=False, params_dtype=torch.float32, prefix="plain")
            assert type(plain) is RowParallelLinear, type(plain)
            print(f"rank {rank}: ok")
        finally:
            mc2.revert()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=WORLD_SIZE, join=True)
