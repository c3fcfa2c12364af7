"""The plugin's modules: one record each. Everything else derives from this table.

A record names the module's switch (the ExtConfig field of the same name, ROLLOUT_EXT_<NAME>) with
its default, the module's own settings (ExtConfig fields too),
the patch that binds it on each stack and what that patch hooks there, or why it does not bind
there; whether it is NPU-only, whether it does anything at tensor_parallel_size=1, and which other
modules it cannot run with. Config, the patch selection, the status line, doctor, the check CLI,
the benchmarks and the equivalence helpers read it. Pure data: importing it imports no vLLM.

Stacks (rollout_ext.platform.stack()): "vllm" is stock vLLM's classes; "ascend-main" and
"ascend-0.23" are vllm-ascend's out-of-tree classes (AscendRotaryEmbedding,
AscendRowParallelLinear, NPUModelRunner, ...), which replace the stock ones when it is installed.

States a module ends in, per process:
- active: its patch hooked the classes this process builds;
- upstream: vllm-ascend already does this here (nothing applied twice);
- inert: nothing to do here (e.g. TP=1), known once the engine config exists;
- refused: it cannot bind here (the reason says why, naming the version);
- off: switched off.
"""

from __future__ import annotations

import msgspec

ACTIVE, UPSTREAM, INERT, REFUSED, OFF = "active", "upstream", "inert", "refused", "off"
STATES = (ACTIVE, UPSTREAM, INERT, REFUSED, OFF)


class Binding(msgspec.Struct, frozen=True, kw_only=True):
    """How a module binds on one stack: a patch and the upstream names it hooks, or a refusal."""

    patch: str | None = None
    hooks: tuple[str, ...] = ()
    # Why it does not bind on this stack (patch is None); the version is added when reported.
    refusal: str = ""


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    """A module's own positive-integer setting: the ExtConfig field `name`, ROLLOUT_EXT_<NAME>."""

    name: str
    default: int
    summary: str
    # A step size in tokens below which the module stands aside (bench --min-tokens sets each one).
    min_tokens: bool = False

    @property
    def variable(self) -> str:
        return f"ROLLOUT_EXT_{self.name.upper()}"


class Module(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    summary: str
    stacks: dict[str, Binding]
    # The switch's value when ROLLOUT_EXT_<NAME> is unset.
    default: bool = False
    settings: tuple[Setting, ...] = ()
    npu_only: bool = False
    # Does nothing at tensor_parallel_size=1.
    needs_tp: bool = False
    # (other module, why they clash and how to resolve it); listed once, on either record.
    conflicts: tuple[tuple[str, str], ...] = ()
    # Old vllm-ascend switches that mean this module.
    aliases: tuple[str, ...] = ()
    # Speculative decoding: it changes what a step verifies, never what greedy decoding picks.
    drafts: bool = False

    @property
    def switch(self) -> str:
        return f"ROLLOUT_EXT_{self.name.upper()}"


# Every module patch that changes the compiled graph also wraps this, so that vLLM's compile cache
# keys differ with the patch set (patches/_compile_key.py).
COMMON_HOOKS: tuple[str, ...] = ("vllm.config.VllmConfig.compute_hash",)

_ASCEND_ROPE = Binding(
    patch="rope_cache_ascend",
    hooks=(
        "vllm_ascend.ops.rotary_embedding.AscendRotaryEmbedding.forward_oot",
        "vllm_ascend.ops.rotary_embedding.AscendRotaryEmbedding.__init__",
        "vllm_ascend.worker.model_runner_v1.update_cos_sin (called by NPUModelRunner.execute_model)",
    ),
)
_ASCEND_MC2 = Binding(
    patch="mc2_ascend",
    hooks=(
        "vllm_ascend.ops.linear.AscendRowParallelLinear.__init__",
        "vllm_ascend.ops.linear.AscendRowParallelLinear.forward",
    ),
)
_FAV2 = Binding(
    patch="fav2_attention",
    hooks=("vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl._forward_prefill_no_cache",),
)

MODULES: tuple[Module, ...] = (
    Module(
        name="rope_cache",
        summary="rope cos/sin gathered once per step, not once per layer",
        default=True,
        stacks={
            "vllm": Binding(
                patch="rope_cache",
                hooks=(
                    "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward",
                    "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.__init__",
                    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
                ),
            ),
            "ascend-main": _ASCEND_ROPE,
            "ascend-0.23": _ASCEND_ROPE,
        },
    ),
    Module(
        name="mc2",
        summary="RowParallelLinear matmul + all-reduce fused (torch_npu.npu_mm_all_reduce_base)",
        stacks={
            "vllm": Binding(
                patch="mc2_row_parallel",
                hooks=("vllm.model_executor.layers.linear.RowParallelLinear (PluggableLayer.register_oot)",),
            ),
            "ascend-main": _ASCEND_MC2,
            "ascend-0.23": _ASCEND_MC2,
        },
        settings=(Setting(name="mc2_min_tokens", default=256, min_tokens=True,
                          summary="fuse only steps of at least this many tokens (the op is meant for prefill)"),),
        needs_tp=True,
        conflicts=(
            ("flashcomm", "both replace the all-reduce after RowParallelLinear. Keep one: mc2 for TP8 "
                          "prefill-heavy runs, flashcomm otherwise."),
        ),
        aliases=("VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE",),
    ),
    Module(
        name="flashcomm",
        summary="all-reduce split into reduce-scatter + all-gather around RMSNorm",
        stacks={
            "vllm": Binding(
                patch="flashcomm",
                hooks=(
                    "vllm.model_executor.models.qwen2.Qwen2Model.__call__",
                    "vllm.model_executor.models.llama.LlamaModel.__call__",
                    "vllm.model_executor.models.qwen2.Qwen2Model.embed_input_ids",
                    "vllm.model_executor.models.llama.LlamaModel.embed_input_ids",
                    "vllm.model_executor.layers.linear.ColumnParallelLinear.forward",
                    "vllm.model_executor.layers.linear.RowParallelLinear.forward",
                ),
            ),
            # vllm-ascend main's linears fall back to vLLM's forward when they have no custom op (a
            # dense model's), so the same wrappers run under AscendRow/ColumnParallelLinear, and its
            # RMSNorm simply gets the token shard (main: checked under the emulation lane).
            "ascend-main": Binding(
                patch="flashcomm",
                hooks=(
                    "vllm.model_executor.models.qwen2.Qwen2Model.__call__",
                    "vllm.model_executor.models.llama.LlamaModel.__call__",
                    "vllm.model_executor.models.qwen2.Qwen2Model.embed_input_ids",
                    "vllm.model_executor.models.llama.LlamaModel.embed_input_ids",
                    "vllm.model_executor.layers.linear.ColumnParallelLinear.forward (reached from "
                    "AscendColumnParallelLinear/AscendMergedColumnParallelLinear/AscendQKVParallelLinear.forward)",
                    "vllm.model_executor.layers.linear.RowParallelLinear.forward (reached from "
                    "AscendRowParallelLinear.forward)",
                ),
            ),
            "ascend-0.23": Binding(refusal=(
                "verified on vllm-ascend main only; 0.23.0 has its own flashcomm1 "
                "(VLLM_ASCEND_ENABLE_FLASHCOMM1), whose sequence-parallel linear ops this has not been "
                "checked against")),
        },
        settings=(Setting(name="flashcomm_min_tokens", default=256, min_tokens=True,
                          summary="shard only steps of at least this many tokens"),),
        needs_tp=True,
        conflicts=(
            ("mlp_only_tp", "flashcomm shards tokens across ranks, and MLP-only TP's replicated attention "
                            "needs every token. Keep one."),
        ),
        aliases=("VLLM_ASCEND_ENABLE_FLASHCOMM", "VLLM_ASCEND_ENABLE_FLASHCOMM1"),
    ),
    Module(
        name="mlp_only_tp",
        summary="attention replicated on every TP rank, only the MLP sharded",
        stacks={
            "vllm": Binding(
                patch="mlp_only_tp",
                hooks=(
                    "vllm.model_executor.models.qwen2.Qwen2Attention.__init__",
                    "vllm.model_executor.models.llama.LlamaAttention.__init__",
                    "vllm.config.ModelConfig.get_num_attention_heads",
                    "vllm.config.ModelConfig.get_num_kv_heads",
                ),
            ),
            # vllm-ascend builds its QKV/row linears through vLLM's PluggableLayer names, so the same
            # constructor wrap passes them disable_tp (main: checked under the emulation lane).
            "ascend-main": Binding(
                patch="mlp_only_tp",
                hooks=(
                    "vllm.model_executor.models.qwen2.Qwen2Attention.__init__ (builds AscendQKVParallelLinear / "
                    "AscendRowParallelLinear with disable_tp=True)",
                    "vllm.model_executor.models.llama.LlamaAttention.__init__",
                    "vllm.config.ModelConfig.get_num_attention_heads",
                    "vllm.config.ModelConfig.get_num_kv_heads",
                ),
            ),
            "ascend-0.23": Binding(refusal=(
                "verified on vllm-ascend main only: whether 0.23.0's AscendQKVParallelLinear and "
                "AscendRowParallelLinear build replicated under disable_tp has not been checked")),
        },
        needs_tp=True,
        aliases=("VLLM_ASCEND_ENABLE_MLP_OPTIMIZE",),
    ),
    Module(
        name="fav2",
        summary="prefill attention through ATB FlashAttention v2 (needs chunked prefill off)",
        # The patch refuses without an NPU, and on vllm-ascend main and 0.23.0, which have no
        # _forward_prefill_no_cache (prefill runs through npu_fused_infer_attention_score on paged KV).
        stacks={"vllm": _FAV2, "ascend-main": _FAV2, "ascend-0.23": _FAV2},
        npu_only=True,
    ),
    Module(
        name="tail_drafting",
        summary="suffix drafting (siblings' and own text) only while few sequences run, more for the longest",
        stacks={
            "vllm": Binding(
                patch="tail_drafting",
                hooks=(
                    "vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose",
                    "vllm.engine.arg_utils.EngineArgs.speculative_config (suffix, batch-size schedule)",
                ),
            ),
            "ascend-main": Binding(
                patch="tail_drafting",
                hooks=(
                    "vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose (reached from "
                    "AscendSuffixDecodingProposer.propose through super().propose)",
                    "vllm.engine.arg_utils.EngineArgs.speculative_config (suffix, batch-size schedule)",
                ),
            ),
            "ascend-0.23": Binding(refusal=(
                "verified on vllm-ascend main only: 0.23.0 with its vLLM 0.23.0 calls the suffix proposer "
                "without the step's draft count (AscendSuffixDecodingProposer.propose: "
                "super().propose(input_batch, sampled_token_ids)), so no batch-size schedule reaches it")),
        },
        settings=(
            Setting(name="draft_tokens", default=8, summary="draft tokens per step for the longest-running sequence"),
            Setting(name="tail_batch_seqs", default=16,
                    summary="drafting runs while at most this many sequences run on the replica"),
        ),
        drafts=True,
    ),
)

BY_NAME: dict[str, Module] = {m.name: m for m in MODULES}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def get(name: str) -> Module:
    if name not in BY_NAME:
        raise KeyError(f"unknown rollout_ext module {name!r}; known: {', '.join(NAMES)}")
    return BY_NAME[name]


def settings() -> tuple[Setting, ...]:
    """Every module's own settings, in table order."""
    return tuple(setting for module in MODULES for setting in module.settings)


def aliases() -> dict[str, str]:
    """Old vllm-ascend switch -> module name."""
    return {alias: m.name for m in MODULES for alias in m.aliases}


def conflict_pairs() -> list[tuple[str, str, str]]:
    """(module, other module, why) for every pair of modules that cannot run together."""
    return [(m.name, other, why) for m in MODULES for other, why in m.conflicts]


def off_env() -> dict[str, str]:
    """Every module switch set to 0."""
    return {m.switch: "0" for m in MODULES}


def switches_on(names) -> dict[str, str]:
    """The switches that turn `names` on, e.g. ("rope_cache", "mc2")."""
    return {get(name).switch: "1" for name in names}
