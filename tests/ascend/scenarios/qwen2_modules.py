"""A Qwen2-shaped model built through vllm-ascend main's custom-op registration, on CPU, with
rope_cache and mc2 bound to the Ascend classes. Run: qwen2_modules.py PORT TP DTYPE [MUTATION].

On every rank:
1. vllm-ascend registers its ops as its NPUWorker does, and the model is loaded as its
   NPUModelRunner loads it (vLLM's get_model, vllm-ascend's weight post-processing); the model's rotary is AscendRotaryEmbedding,
   its o_proj and down_proj AscendRowParallelLinear, its norms AscendRMSNorm. Beside the model, one
   AscendRowParallelLinear with a bias (Qwen2's row-parallel layers have none).
2. Unpatched, two steps as NPUModelRunner runs them, each at its own positions:
   `update_cos_sin(positions)` by the name the runner calls, then every layer's rope (vllm-ascend:
   torch_npu.npu_mrope per layer, the per-layer gather; q and k are strided views into one qkv
   tensor, as Qwen2Attention.forward splits them) and every layer's o_proj and down_proj at
   prefill size and at decode size, then the biased layer at both sizes.
3. The plugin binds the modules (stack detection must say ascend-main), the lane's fresh model
   state wipes vllm-ascend's per-step cos/sin buffers (NaN: nothing gathered), a second model is loaded
   from the same checkpoint, and the same two steps run again. Asserted:
   - rope: after each step's update_cos_sin, vllm-ascend's `_cos`/`_sin` hold that step's rows
     (what its gather writes, compared with the unpatched run's); zero per-layer gathers,
     npu_apply_rotary_pos_emb once per layer and step, npu_mrope never; outputs equal the unpatched
     layer's (fp32: 1e-6; bf16: its rounding);
   - mc2: the call log (layer, projection, tokens, ops) of every o_proj/down_proj call: at TP=2 in
     bf16 exactly the prefill-size calls go through npu_mm_all_reduce_base, decode-size ones do
     not; the outputs, the biased layer's included, equal the unpatched layers';
   - revert() restores vllm-ascend's classes exactly.
MUTATION (tests only: a wrong module injected after the plugin binds, which must fail here):
rope_never_gathers, mc2_decode_only, mc2_bias_every_rank.
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
STEPS = 2
BIASED_PREFIX = "model.layers.99.self_attn.o_proj"  # a dense row-parallel layer name, unused by the model


def build_biased(vllm_config, weights=None):
    """An AscendRowParallelLinear with a bias, random (seed 7) or with `weights`."""
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_ascend.ops.linear import AscendRowParallelLinear

    hidden = vllm_config.model_config.hf_config.hidden_size
    with set_default_torch_dtype(vllm_config.model_config.dtype):
        layer = AscendRowParallelLinear(hidden, hidden, bias=True, prefix=BIASED_PREFIX)
    if weights is None:
        # Weights as the model's; a bias large beside the output, so a bias summed over ranks shows.
        gen = torch.Generator().manual_seed(7)
        layer.weight.data.copy_((torch.randn(layer.weight.shape, generator=gen) * 0.05).to(layer.weight.dtype))
        layer.bias.data.copy_((torch.randn(layer.bias.shape, generator=gen) * 0.5).to(layer.bias.dtype))
    else:
        layer.load_state_dict(weights)
    return layer


def run_steps(model, biased, runner_module, gen, dtype):
    """STEPS steps: the runner's per-step cos/sin fill, then each layer's rope and row-parallel
    layers, then the biased layer. Returns the outputs, the op counts, the call log of the
    row-parallel calls and each step's cos/sin rows as the buffers held them after the fill."""
    import torch_npu
    from vllm_ascend.ops import rotary_embedding

    start = len(torch_npu.CALLS)
    outputs, log, buffers = [], [], []

    def row_parallel(layer_index, name, layer, tokens):
        x = torch.randn(tokens, layer.input_size_per_partition, generator=gen).to(dtype)
        before = len(torch_npu.CALLS)
        outputs.append((f"{name} layer {layer_index} tokens {tokens}", layer(x)[0]))
        log.append({"layer": layer_index, "proj": name, "tokens": tokens,
                    "ops": [op for op, _ in torch_npu.CALLS[before:]]})

    for _ in range(STEPS):
        positions = torch.randint(0, 500, (PREFILL_TOKENS,), generator=gen)
        runner_module.update_cos_sin(positions)
        buffers.append((rotary_embedding._cos[:, :PREFILL_TOKENS].clone(),
                        rotary_embedding._sin[:, :PREFILL_TOKENS].clone()))
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            # As Qwen2Attention.forward hands them over: strided views into one qkv projection.
            qkv = torch.randn(PREFILL_TOKENS, attn.q_size + 2 * attn.kv_size, generator=gen).to(dtype)
            q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            assert not q.is_contiguous() and not k.is_contiguous()
            outputs += [(f"rope layer {index}", out.clone()) for out in attn.rotary_emb(positions, q, k)]
            outputs.append((f"qkv after rope, layer {index}", qkv))  # what an in-place rope left behind
            for tokens in (PREFILL_TOKENS, DECODE_TOKENS):
                row_parallel(index, "o_proj", attn.o_proj, tokens)
                row_parallel(index, "down_proj", mlp.down_proj, tokens)
        for tokens in (PREFILL_TOKENS, DECODE_TOKENS):
            row_parallel(-1, "biased", biased, tokens)
    calls = [op for op, _ in torch_npu.CALLS[start:]]
    return outputs, {op: calls.count(op) for op in sorted(set(calls))}, log, buffers


def mutate(name: str) -> None:
    """A wrong module, injected after the plugin bound the right one."""
    from rollout_ext.ops import linear

    if name == "rope_never_gathers":
        from rollout_ext.patches import rope_cache
        from rollout_ext.patches._context import set_context
        from vllm_ascend.worker import model_runner_v1

        def update_cos_sin(positions):  # records the step and counts it, but never gathers
            set_context(rope_positions=positions)
            rope_cache.COUNTERS.add("step_gathers")
            rope_cache.COUNTERS.add("forwards")

        model_runner_v1.update_cos_sin = update_cos_sin
    elif name == "mc2_decode_only":
        eligible = linear.mc2_eligible

        def inverted(x, weight, *, tp_size, min_tokens, quantized):  # fuses only below the threshold
            tokens = x.numel() // x.shape[-1]
            return eligible(x, weight, tp_size=tp_size, min_tokens=0, quantized=quantized) and tokens < min_tokens

        linear.mc2_eligible = inverted
    elif name == "mc2_bias_every_rank":
        import torch_npu

        def every_rank(x, weight, bias, group):  # the reduction then sums tp copies of the bias
            hcom = linear.hcom_for_group(group.device_group)
            return torch_npu.npu_mm_all_reduce_base(x, weight.t(), hcom, reduce_op="sum", bias=bias)

        linear.matmul_all_reduce_npu = every_rank
    else:
        raise SystemExit(f"MUTATION={name!r}; allowed: rope_never_gathers, mc2_decode_only, mc2_bias_every_rank")


def worker(rank: int, port: int, tp: int, dtype_name: str, mutation: str | None = None) -> None:
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
        plain_biased = build_biased(vllm_config)
        layer = plain.model.layers[0]
        assert type(layer.self_attn.rotary_emb) is AscendRotaryEmbedding, type(layer.self_attn.rotary_emb)
        assert type(layer.self_attn.o_proj) is AscendRowParallelLinear, type(layer.self_attn.o_proj)
        assert type(layer.mlp.down_proj) is AscendRowParallelLinear, type(layer.mlp.down_proj)
        assert type(layer.input_layernorm) is AscendRMSNorm, type(layer.input_layernorm)
        assert layer.self_attn.o_proj.custom_op is None  # main: dense o_proj has no custom op
        num_layers = len(plain.model.layers)

        expected, plain_calls, _, expected_buffers = run_steps(
            plain, plain_biased, model_runner_v1, torch.Generator().manual_seed(1 + rank), dtype)
        assert plain_calls.get("npu_mrope") == STEPS * num_layers, plain_calls

        assert stack() == "ascend-main", stack()
        cfg = ExtConfig(rope_cache=True, mc2=True, mc2_min_tokens=MIN_TOKENS, strict=True)
        applied, states = plugin.apply_patches(cfg)
        assert "ascend_import_order" in applied, applied
        assert {n: s.state for n, s in states.items() if s.state != "off"} == {
            "rope_cache": "active", "mc2": "active"}, states
        assert "rope_cache_ascend" in applied and "mc2_ascend" in applied, applied
        if mutation:
            mutate(mutation)

        rope_cache.COUNTERS.reset()
        mc2_row_parallel.COUNTERS.reset()
        lane.fresh_model_state(vllm_config)  # the per-step cos/sin buffers too: NaN
        patched = lane.build(vllm_config, seed=0)  # the same checkpoint, loaded again
        patched_biased = build_biased(vllm_config, weights=plain_biased.state_dict())
        got, patched_calls, log, buffers = run_steps(
            patched, patched_biased, model_runner_v1, torch.Generator().manual_seed(1 + rank), dtype)
        # The gather itself, not a counter: each step's buffers hold the rows vllm-ascend's gather wrote.
        for step, ((cos, sin), (want_cos, want_sin)) in enumerate(zip(buffers, expected_buffers)):
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (
                f"step {step}: vllm-ascend's cos/sin buffers do not hold this step's rows after update_cos_sin "
                f"({int(torch.isnan(cos).sum())} NaN of {cos.numel()})")
        counters = rope_cache.COUNTERS.read()
        assert counters["step_gathers"] == STEPS and counters["layer_gathers"] == 0, counters
        assert patched_calls.get("npu_apply_rotary_pos_emb") == STEPS * num_layers, patched_calls
        assert "npu_mrope" not in patched_calls, patched_calls
        # mc2, call by call: exactly the prefill-size calls fuse, where the op applies (TP>1, bf16).
        fuses = tp > 1 and dtype != torch.float32
        for call in log:
            fused = call["ops"].count("npu_mm_all_reduce_base")
            assert fused == int(fuses and call["tokens"] >= MIN_TOKENS), f"fused calls: {call}"
        fused_expected = STEPS * (2 * num_layers + 1) if fuses else 0
        assert patched_calls.get("npu_mm_all_reduce_base", 0) == fused_expected, patched_calls
        mc2_counts = mc2_row_parallel.COUNTERS.read()
        takes = STEPS * (4 * num_layers + 2) if tp > 1 else 0
        assert mc2_counts == {"calls": takes, "fused": fused_expected}, mc2_counts

        tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        assert [name for name, _ in got] == [name for name, _ in expected]
        for i, ((name, a), (_, b)) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, b, **tolerance, msg=lambda m, i=i, name=name: f"output {i} ({name}): {m}")

        plugin_patches = list(applied)
        while applied:
            from rollout_ext import patches

            patches.load(applied.pop()).revert()
        assert AscendRotaryEmbedding.__dict__["forward_oot"] is originals["forward_oot"]
        assert AscendRotaryEmbedding.__dict__["__init__"] is originals["rope_init"]
        assert AscendRowParallelLinear.__dict__["forward"] is originals["row_forward"]
        assert model_runner_v1.update_cos_sin is originals["update_cos_sin"]
        report = {"tp": tp, "dtype": dtype_name, "layers": num_layers, "steps": STEPS,
                  "unpatched_calls": plain_calls, "patched_calls": patched_calls, "rope": counters,
                  "mc2": mc2_counts, "mc2_log": log, "applied": plugin_patches}
        print(f"rank {rank}: ok {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    port, tp, dtype_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mutation = sys.argv[4] if len(sys.argv) > 4 else None
    if tp == 1:
        worker(0, port, tp, dtype_name, mutation)
    else:
        mp.spawn(worker, args=(port, tp, dtype_name, mutation), nprocs=tp, join=True)
