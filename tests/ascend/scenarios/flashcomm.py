"""Flashcomm on vllm-ascend main's classes, two emulated HCCL ranks. Run: flashcomm.py PORT.

A decoder-MLP-shaped block built from vLLM's layer names, which vllm-ascend's registration turns
into AscendRMSNorm (torch_npu.npu_rms_norm / npu_add_rms_norm), AscendMergedColumnParallelLinear,
AscendSiluAndMul (npu_swiglu) and AscendRowParallelLinear, runs once unpatched and once after the
plugin bound flashcomm (stack ascend-main), for token counts that TP divides and that it does not
(1, 5, 8). The bound run goes through flashcomm's own model-level wrapper (`make_model_call`: its
`plan_step` decides, its embedding wrapper shards, it gathers the result), on a one-layer model
of the block, as it wraps Qwen2Model; the attention kernel of a real decoder layer does not run on
the lane. Asserted: the output equals the unpatched block's (fp32, 1e-6); each call was planned as
a sharded step, the block reduce-scattered twice and all-gathered twice through the Ascend
linears' vLLM forward path, plus the wrapper's final gather; the Ascend norms ran on the token
shard; a call below the token threshold is not sharded (the control). Revert restores vLLM's
linear forwards. Prints "rank N: ok <json>".
"""

import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TP, HIDDEN, INTERMEDIATE = 2, 48, 80


class Block(torch.nn.Module):
    """norm -> (gate_up -> act -> down -> add+norm) twice, as a Qwen2 MLP stack is wired."""

    def __init__(self, rank, gen):
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.norms = torch.nn.ModuleList(RMSNorm(HIDDEN, eps=1e-6) for _ in range(3))
        self.ups = torch.nn.ModuleList(
            MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, bias=False, params_dtype=torch.float32,
                                       prefix=f"layers.{i}.mlp.gate_up_proj") for i in range(2))
        self.downs = torch.nn.ModuleList(
            RowParallelLinear(INTERMEDIATE, HIDDEN, bias=(i == 0), params_dtype=torch.float32,
                              prefix=f"layers.{i}.mlp.down_proj") for i in range(2))
        self.act = SiluAndMul()
        half = INTERMEDIATE // TP
        for up in self.ups:
            full = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5
            gate, upw = full[:INTERMEDIATE], full[INTERMEDIATE:]
            up.weight.data.copy_(torch.cat([gate[rank * half:(rank + 1) * half], upw[rank * half:(rank + 1) * half]]))
        for down in self.downs:
            full = torch.randn(HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5
            down.weight.data.copy_(full[:, rank * half:(rank + 1) * half])
            if down.bias is not None:
                down.bias.data.copy_(torch.randn(HIDDEN, generator=gen))
        for norm in self.norms:
            norm.weight.data.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))

    def forward(self, hidden):
        residual = hidden
        hidden = self.norms[0](hidden)
        for i in range(2):
            hidden = self.downs[i](self.act(self.ups[i](hidden)[0]))[0]
            hidden, residual = self.norms[i + 1](hidden, residual)
        return hidden


class OneLayerModel(torch.nn.Module):
    """The block as flashcomm sees a decoder stack: `layers`, an embedding, forward(input_ids, positions)."""

    def __init__(self, block, gen):
        super().__init__()
        self.layers = torch.nn.ModuleList([block])
        self.table = torch.randn(16, HIDDEN, generator=gen)

    def embed_input_ids(self, input_ids):
        return self.table[input_ids]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.layers[0](self.embed_input_ids(input_ids))


def worker(rank: int, port: int) -> None:
    import torch_npu
    from vllm.distributed import get_tp_group
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    from rollout_ext import patches, plugin
    from rollout_ext.config import ExtConfig
    from rollout_ext.patches import flashcomm
    from rollout_ext.platform import stack

    with lane.tp_group(rank, port, TP) as vllm_config:
        from vllm_ascend.ops.activation import AscendSiluAndMul
        from vllm_ascend.ops.layernorm import AscendRMSNorm
        from vllm_ascend.ops.linear import AscendMergedColumnParallelLinear, AscendRowParallelLinear

        originals = (ColumnParallelLinear.__dict__["forward"], RowParallelLinear.__dict__["forward"])
        gen = torch.Generator().manual_seed(0)
        block = Block(rank, gen)
        assert type(block.norms[0]) is AscendRMSNorm and type(block.act) is AscendSiluAndMul
        assert type(block.ups[0]) is AscendMergedColumnParallelLinear and block.ups[0].custom_op is None
        assert type(block.downs[0]) is AscendRowParallelLinear and block.downs[0].custom_op is None
        model = OneLayerModel(block, gen)
        ids = [torch.randint(0, 16, (tokens,), generator=gen) for tokens in (1, 5, 8)]
        start = len(torch_npu.CALLS)
        expected = [model(x, torch.arange(x.shape[0])) for x in ids]
        unpatched_calls = sorted({op for op, _ in torch_npu.CALLS[start:]})

        assert stack() == "ascend-main", stack()
        applied, states = plugin.apply_patches(ExtConfig(rope_cache=False, flashcomm=True,
                                                         flashcomm_min_tokens=1, strict=True))
        assert states["flashcomm"].state == "active", states
        # flashcomm's wrappers, as apply() puts them on Qwen2Model, put on the one-layer model.
        signature = inspect.signature(OneLayerModel.forward)
        OneLayerModel.embed_input_ids = flashcomm.make_embed(OneLayerModel.embed_input_ids)
        wrapped = {threshold: flashcomm.make_model_call(torch.nn.Module.__call__, signature, threshold, (Block,))
                   for threshold in (1, 16)}
        group = get_tp_group()
        shard_rows = []
        for x, want in zip(ids, expected):
            flashcomm.COUNTERS.reset()
            norm_rows = []
            hook = block.norms[1].register_forward_pre_hook(lambda m, a: norm_rows.append(a[0].shape[0]))
            try:
                got = wrapped[1](model, x, torch.arange(x.shape[0]))
            finally:
                hook.remove()
            step = flashcomm.Step(group=group, num_tokens=x.shape[0])
            assert norm_rows == [step.shard_rows], norm_rows  # the Ascend norm ran on the shard
            # One planned step; the block's own collectives (a reduce-scatter per down_proj, an
            # all-gather per gate_up_proj) and the wrapper's gather of the result.
            assert flashcomm.COUNTERS.read() == {"steps": 1, "reduce_scatters": 2, "all_gathers": 3}, flashcomm.COUNTERS.read()
            assert flashcomm.active_step() is None
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            shard_rows.append(step.shard_rows)
        # Control: below the token threshold plan_step declines, and the block runs whole.
        flashcomm.COUNTERS.reset()
        torch.testing.assert_close(wrapped[16](model, ids[2], torch.arange(8)), expected[2], rtol=1e-6, atol=1e-6)
        assert flashcomm.COUNTERS.read() == {"steps": 0, "reduce_scatters": 0, "all_gathers": 0}, flashcomm.COUNTERS.read()

        while applied:
            patches.load(applied.pop()).revert()
        assert (ColumnParallelLinear.__dict__["forward"], RowParallelLinear.__dict__["forward"]) == originals
        report = {"shard_rows": shard_rows, "unpatched_calls": unpatched_calls}
        print(f"rank {rank}: ok {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=TP, join=True)
