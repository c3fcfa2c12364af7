"""A Qwen2-shaped model built through vllm-ascend main's custom-op registration, on CPU, with
rope_cache and mc2 bound to the Ascend classes. Run: qwen2_modules.py PORT TP DTYPE.

On every rank:
1. vllm-ascend registers its ops as its NPUWorker does; the model's rotary is AscendRotaryEmbedding,
   its o_proj and down_proj AscendRowParallelLinear, its norms AscendRMSNorm.
2. Unpatched, one step as NPUModelRunner runs it: `update_cos_sin(positions)` by the name the runner
   calls, then every layer's rope (vllm-ascend: torch_npu.npu_mrope per layer, the per-layer
   gather) and every layer's o_proj and down_proj at prefill size and at decode size.
3. The plugin binds the modules (stack detection must say ascend-main), a second model is built
   with the first one's weights, and the same step runs again. Asserted:
   - rope: one step gather, zero per-layer gathers, npu_apply_rotary_pos_emb once per layer and
     npu_mrope never; outputs equal the unpatched layer's (fp32: 1e-6; bf16: its rounding);
   - mc2: the dispatch takes every o_proj/down_proj call; at TP=2 in bf16 the prefill-size calls go
     through npu_mm_all_reduce_base (one per layer and projection), decode-size ones do not; the
     outputs equal the unpatched layers';
   - revert() restores vllm-ascend's classes exactly.
Prints "rank N: ok <json>".
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PREFILL_TOKENS, DECODE_TOKENS, MIN_TOKENS = 40, 3, 16


def run_step(model, runner_module, gen, dtype):
    """One step: the runner's per-step cos/sin fill, then each layer's rope and row-parallel layers."""
    import torch_npu

    config = model.config
    start = len(torch_npu.CALLS)
    positions = torch.randint(0, 500, (PREFILL_TOKENS,), generator=gen)
    runner_module.update_cos_sin(positions)
    outputs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q = torch.randn(PREFILL_TOKENS, attn.q_size, generator=gen).to(dtype)
        k = torch.randn(PREFILL_TOKENS, attn.kv_size, generator=gen).to(dtype)
        outputs += list(attn.rotary_emb(positions, q, k))
        for tokens in (PREFILL_TOKENS, DECODE_TOKENS):
            x = torch.randn(tokens, attn.o_proj.input_size_per_partition, generator=gen).to(dtype)
            outputs.append(attn.o_proj(x)[0])
            y = torch.randn(tokens, mlp.down_proj.input_size_per_partition, generator=gen).to(dtype)
            outputs.append(mlp.down_proj(y)[0])
    calls = [op for op, _ in torch_npu.CALLS[start:]]
    assert config.num_hidden_layers == len(model.model.layers)
    return outputs, {op: calls.count(op) for op in sorted(set(calls))}


def worker(rank: int, port: int, tp: int, dtype_name: str) -> None:
    from rollout_ext import plugin
    from rollout_ext.config import ExtConfig
    from rollout_ext.patches import mc2_row_parallel, rope_cache
    from rollout_ext.platform import stack

    dtype = getattr(torch, dtype_name)
    with lane.tp_group(rank, port, tp, dtype_name) as vllm_config:
        from vllm_ascend.ops.layernorm import AscendRMSNorm
        from vllm_ascend.ops.linear import AscendRowParallelLinear
        from vllm_ascend.ops.rotary_embedding import AscendRotaryEmbedding
        from vllm_ascend.worker import model_runner_v1

        originals = {
            "forward_oot": AscendRotaryEmbedding.__dict__["forward_oot"],
            "rope_init": AscendRotaryEmbedding.__dict__["__init__"],
            "row_forward": AscendRowParallelLinear.__dict__["forward"],
            "update_cos_sin": model_runner_v1.update_cos_sin,
        }
        plain = lane.build(vllm_config, seed=0)
        layer = plain.model.layers[0]
        assert type(layer.self_attn.rotary_emb) is AscendRotaryEmbedding, type(layer.self_attn.rotary_emb)
        assert type(layer.self_attn.o_proj) is AscendRowParallelLinear, type(layer.self_attn.o_proj)
        assert type(layer.mlp.down_proj) is AscendRowParallelLinear, type(layer.mlp.down_proj)
        assert type(layer.input_layernorm) is AscendRMSNorm, type(layer.input_layernorm)
        assert layer.self_attn.o_proj.custom_op is None  # main: dense o_proj has no custom op
        num_layers = len(plain.model.layers)

        expected, plain_calls = run_step(plain, model_runner_v1, torch.Generator().manual_seed(1 + rank), dtype)
        assert plain_calls.get("npu_mrope") == num_layers, plain_calls

        assert stack() == "ascend-main", stack()
        # strict=False for the infrastructure only: vllm_ascend.patch.worker imports torchvision,
        # which this CPU stack cannot have (its wheels are CUDA builds), so ascend_import_order
        # logs and stays unapplied here. Both modules must still bind.
        cfg = ExtConfig(rope_cache=True, mc2=True, mc2_min_tokens=MIN_TOKENS, strict=False)
        applied, states = plugin.apply_patches(cfg)
        assert "ascend_import_order" not in applied, applied
        assert {n: s.state for n, s in states.items() if s.state != "off"} == {
            "rope_cache": "active", "mc2": "active"}, states
        assert "rope_cache_ascend" in applied and "mc2_ascend" in applied, applied

        rope_cache.reset_counters()
        mc2_row_parallel.reset_counts()
        lane.fresh_model_state(vllm_config)
        patched = lane.build(vllm_config, weights=plain.state_dict())
        got, patched_calls = run_step(patched, model_runner_v1, torch.Generator().manual_seed(1 + rank), dtype)
        counters = rope_cache.counters()
        assert counters["step_gathers"] == 1 and counters["layer_gathers"] == 0, counters
        assert patched_calls.get("npu_apply_rotary_pos_emb") == num_layers, patched_calls
        assert "npu_mrope" not in patched_calls, patched_calls
        fused_expected = 2 * num_layers if (tp > 1 and dtype != torch.float32) else 0
        assert patched_calls.get("npu_mm_all_reduce_base", 0) == fused_expected, patched_calls
        mc2_counts = mc2_row_parallel.counts()
        takes = 4 * num_layers if tp > 1 else 0
        assert mc2_counts == {"calls": takes, "fused": fused_expected}, mc2_counts

        tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        for i, (a, b) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, b, **tolerance, msg=lambda m, i=i: f"output {i}: {m}")

        plugin_patches = list(applied)
        while applied:
            from rollout_ext import patches

            patches.load(applied.pop()).revert()
        assert AscendRotaryEmbedding.__dict__["forward_oot"] is originals["forward_oot"]
        assert AscendRotaryEmbedding.__dict__["__init__"] is originals["rope_init"]
        assert AscendRowParallelLinear.__dict__["forward"] is originals["row_forward"]
        assert model_runner_v1.update_cos_sin is originals["update_cos_sin"]
        report = {"tp": tp, "dtype": dtype_name, "layers": num_layers, "unpatched_calls": plain_calls,
                  "patched_calls": patched_calls, "rope": counters, "mc2": mc2_counts,
                  "applied": plugin_patches}
        print(f"rank {rank}: ok {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    port, tp, dtype_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if tp == 1:
        worker(0, port, tp, dtype_name)
    else:
        mp.spawn(worker, args=(port, tp, dtype_name), nprocs=tp, join=True)
