"""Two CPU ranks under vLLM's real distributed state, with the flashcomm patch applied.

A decoder-layer-shaped block built from vLLM's own layers (RMSNorm with fused residual add,
MergedColumnParallelLinear, SiluAndMul, RowParallelLinear, twice) runs once as vLLM does and once
inside a flashcomm Step, for token counts that TP divides and that it does not (1, 5, 8). The
gathered output must equal vLLM's exactly (TP=2: a two-term sum is the same in either collective),
and the Step must really have reduce-scattered and all-gathered. With no Step running, the
wrapped layers trace under torch.compile(fullgraph=True) and compute vLLM's result.
"""

import sys

import torch
import torch.multiprocessing as mp

from rollout_ext.testing.dist import vllm_tp_group

WORLD_SIZE = 2
HIDDEN, INTERMEDIATE = 48, 80


class Block(torch.nn.Module):
    def __init__(self, rank, gen):
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.norms = torch.nn.ModuleList(RMSNorm(HIDDEN, eps=1e-6) for _ in range(3))
        self.ups = torch.nn.ModuleList(
            MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False, params_dtype=torch.float32,
                                       prefix=f"up{i}") for i in range(2))
        self.downs = torch.nn.ModuleList(
            RowParallelLinear(INTERMEDIATE, HIDDEN, bias=(i == 0), params_dtype=torch.float32, prefix=f"down{i}")
            for i in range(2))
        self.act = SiluAndMul()
        half = INTERMEDIATE // WORLD_SIZE
        for up in self.ups:
            full = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
            gate, upw = full[:INTERMEDIATE], full[INTERMEDIATE:]
            up.weight.data.copy_(torch.cat([gate[rank * half:(rank + 1) * half], upw[rank * half:(rank + 1) * half]]))
            up.quant_method.process_weights_after_loading(up)
        for down in self.downs:
            full = torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
            down.weight.data.copy_(full[:, rank * half:(rank + 1) * half])
            if down.bias is not None:
                down.bias.data.copy_(torch.randn(HIDDEN, generator=gen))
            down.quant_method.process_weights_after_loading(down)
        for norm in self.norms:
            norm.weight.data.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))

    def forward(self, hidden):
        residual = hidden
        hidden = self.norms[0](hidden)
        for i in range(2):
            hidden = self.downs[i](self.act(self.ups[i](hidden)[0]))[0]
            hidden, residual = self.norms[i + 1](hidden, residual)
        return hidden


def worker(rank: int, port: int) -> None:
    from vllm.distributed import get_tp_group

    from rollout_ext.config import ExtConfig
    from rollout_ext.patches import flashcomm
    from rollout_ext.patches._context import step_context

    with vllm_tp_group(rank, port, WORLD_SIZE):
        try:
            gen = torch.Generator().manual_seed(0)
            block = Block(rank, gen)
            flashcomm.apply(ExtConfig(flashcomm=True, flashcomm_min_tokens=1))
            group = get_tp_group()
            for tokens in (1, 5, 8):
                x = torch.randn(tokens, HIDDEN, generator=gen)
                expected = block(x)
                flashcomm.COUNTERS.reset()
                step = flashcomm.Step(group=group, num_tokens=tokens)
                with step_context(flashcomm_step=step):
                    sharded = block(step.shard(x))
                assert sharded.shape == (step.shard_rows, HIDDEN), sharded.shape
                got = step.all_gather(sharded)
                assert torch.equal(got, expected), (tokens, (got - expected).abs().max())
                assert flashcomm.COUNTERS.read()["reduce_scatters"] == 2, flashcomm.COUNTERS.read()
                assert flashcomm.COUNTERS.read()["all_gathers"] == 3, flashcomm.COUNTERS.read()
            # Inactive: the wrappers are vLLM's path (no collectives of ours), also when dynamo
            # traces them as vLLM's compiled graph does (fullgraph: no graph break allowed).
            flashcomm.COUNTERS.reset()
            compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
            for tokens in (3, 6):
                x = torch.randn(tokens, HIDDEN, generator=gen)
                torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)
            assert flashcomm.COUNTERS.read() == {"steps": 0, "reduce_scatters": 0, "all_gathers": 0}
            print(f"rank {rank}: ok")
        finally:
            flashcomm.revert()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=WORLD_SIZE, join=True)
