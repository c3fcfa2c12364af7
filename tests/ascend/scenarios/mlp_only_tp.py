"""MLP-only TP on vllm-ascend main's classes, two emulated HCCL ranks. Run: mlp_only_tp.py PORT.

On every rank, the same HF-format weights are loaded (through the model's own load_weights) into
1. a Qwen2-shaped model built through vllm-ascend's registration with sharded attention (TP=2), and
2. the same model built after the plugin bound mlp_only_tp (stack ascend-main).
Asserted on (2): attention is replicated on the Ascend classes (AscendQKVParallelLinear and
AscendRowParallelLinear with tp_size 1 and full weights, all query and KV heads on each rank, the
engine's per-rank KV head count agrees); the MLP stays sharded. Outputs equal (1)'s within fp32
tolerance: qkv_proj equals (1)'s per-rank shards gathered, o_proj on the full attention output
equals (1)'s o_proj on this rank's head shard after its all-reduce, and the MLP's projections are
unchanged (still sharded).
Revert restores the wrapped constructors. Prints "rank N: ok <json>".
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TP, TOKENS = 2, 5


def hf_weights(config, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF-format weights for the model's config, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    weights = {"model.embed_tokens.weight": rand(config.vocab_size, hidden), "model.norm.weight": 1 + rand(hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(q, hidden), p + "self_attn.q_proj.bias": rand(q),
            p + "self_attn.k_proj.weight": rand(kv, hidden), p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": 1 + rand(hidden), p + "post_attention_layernorm.weight": 1 + rand(hidden),
        }
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = rand(config.vocab_size, hidden)
    return weights


def loaded(vllm_config, weights):
    return lane.build(vllm_config, weights=weights)


def worker(rank: int, port: int) -> None:
    from vllm.distributed import get_tp_group

    from rollout_ext import patches, plugin
    from rollout_ext.config import ExtConfig
    from rollout_ext.platform import stack

    with lane.tp_group(rank, port, TP) as vllm_config:
        from vllm.model_executor.models import qwen2
        from vllm_ascend.ops.linear import AscendQKVParallelLinear, AscendRowParallelLinear

        group = get_tp_group()
        original_init = qwen2.Qwen2Attention.__dict__["__init__"]

        config = vllm_config.model_config.hf_config
        weights = hf_weights(config, seed=7)
        sharded = loaded(vllm_config, weights)
        gen = torch.Generator().manual_seed(3)  # same inputs on both ranks
        x = torch.randn(TOKENS, config.hidden_size, generator=gen)
        full_heads = torch.randn(TOKENS, config.num_attention_heads * config.head_dim, generator=gen)
        inter = torch.randn(TOKENS, config.intermediate_size // TP, generator=gen)
        expected = []
        for layer in sharded.model.layers:
            attn = layer.self_attn
            assert attn.num_heads == config.num_attention_heads // TP
            qkv = attn.qkv_proj(x)[0]
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k, v = (group.all_gather(t.contiguous(), dim=-1) for t in (q, k, v))
            shard = full_heads.chunk(TP, dim=-1)[rank]
            mlp = layer.mlp
            expected.append((q, k, v, attn.o_proj(shard)[0], mlp.gate_up_proj(x)[0], mlp.down_proj(inter)[0]))

        assert stack() == "ascend-main", stack()
        applied, states = plugin.apply_patches(ExtConfig(rope_cache=False, mlp_only_tp=True, strict=True))
        assert states["mlp_only_tp"].state == "active", states
        assert "mlp_only_tp" in applied, applied

        lane.fresh_model_state(vllm_config)
        replicated = loaded(vllm_config, weights)
        attn = replicated.model.layers[0].self_attn
        assert type(attn.qkv_proj) is AscendQKVParallelLinear and type(attn.o_proj) is AscendRowParallelLinear
        assert attn.qkv_proj.tp_size == 1 and attn.o_proj.tp_size == 1
        assert (attn.num_heads, attn.num_kv_heads) == (config.num_attention_heads, config.num_key_value_heads)
        assert tuple(attn.o_proj.weight.shape) == (config.hidden_size, config.num_attention_heads * config.head_dim)
        mlp = replicated.model.layers[0].mlp
        assert mlp.down_proj.tp_size == TP and mlp.down_proj.input_size_per_partition == config.intermediate_size // TP
        kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
        assert kv_heads == config.num_key_value_heads, kv_heads

        for i, layer in enumerate(replicated.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            mlp = layer.mlp
            got = (q, k, v, attn.o_proj(full_heads)[0], mlp.gate_up_proj(x)[0], mlp.down_proj(inter)[0])
            for name, a, b in zip(("q", "k", "v", "o_proj", "gate_up", "down"), got, expected[i]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"layer {i} {n}: {m}")

        while applied:
            patches.load(applied.pop()).revert()
        assert qwen2.Qwen2Attention.__dict__["__init__"] is original_init
        report = {"replicated_heads": [attn.num_heads, attn.num_kv_heads], "o_proj_tp_size": attn.o_proj.tp_size,
                  "down_proj_tp_size": mlp.down_proj.tp_size, "kv_heads_per_rank": kv_heads}
        print(f"rank {rank}: ok {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=TP, join=True)
