"""Replicates attention on every tensor-parallel rank; only the MLP stays sharded (MLP-only TP).

Replaces: `Qwen2Attention.__init__` (vllm.model_executor.models.qwen2) and `LlamaAttention.__init__`
(vllm.model_executor.models.llama) with wrappers that build the same layer with TP switched off:
qkv_proj and o_proj get vLLM's own `disable_tp=True` (full weights on every rank, tp_rank 0, so the
stock weight loaders read whole q/k/v shards, the Qwen2 qkv bias and o_proj), and the layer sees a
TP world size of 1 (all query heads, all KV heads, no all-reduce after o_proj). Also replaces
`ModelConfig.get_num_attention_heads` / `get_num_kv_heads` so that vLLM's KV cache spec, page sizes
and attention metadata builders see the per-rank head counts the layers really have.
Why: at TP8 on small-head-count models, attention's all-reduce and KV-head replication cost more than
the duplicated attention math; the MLP (gate_up column-parallel, down_proj row-parallel with its
all-reduce) keeps the memory win. Same idea as vllm-ascend's VLLM_ASCEND_ENABLE_MLP_OPTIMIZE.
Mechanism: class attribute swaps. `PluggableLayer.register_oot` does not fit: the layers themselves
are unchanged, only how the attention module constructs them. During one wrapped `__init__` the model
module's globals `get_tensor_model_parallel_world_size`, `QKVParallelLinear` and `RowParallelLinear`
are swapped for TP-less versions and restored in a `finally` (model construction is single-threaded).
Only Qwen2ForCausalLM and LlamaForCausalLM are replicated; any other architecture is refused at engine
config time by `check_engine`, which the one engine-time hook (engine_config_check) calls (PatchError,
or a warning and an unpatched model with ROLLOUT_EXT_STRICT=0), and the wrappers leave it untouched.
The compile cache key gets this patch mixed in (`_compile_key`, as every graph-changing patch does),
so torch.compile never reuses a sharded-attention graph of the same model (vLLM hashes the config
and traced source, not weight shapes).
Forward code is untouched, so eager and torch.compile behave alike; no runtime threshold is involved.
Targets: vllm>=0.23,<0.28 (same attention constructors and `disable_tp` in 0.23.0 and 0.27.1).
Upstream: none in vLLM; vllm-ascend's MLP optimisation. Undo: revert().
Remove when vllm-ascend's fine-grained TP (mlp_tensor_parallel_size) accepts dense models.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from types import SimpleNamespace

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._ascend import require_vllm_linear_forward
from rollout_ext.patches._base import PatchError, Swaps, require_signature, require_vllm
from rollout_ext.patches._compile_key import add_compile_key

NAME = "mlp_only_tp"
logger = logging.getLogger("vllm.rollout_ext")

# Architecture -> (model module, attention class) whose construction we wrap.
SUPPORTED = {
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "Qwen2Attention"),
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "LlamaAttention"),
}
# Leading constructor parameters our wrapper passes through unchanged (checked, not relied on by name).
ATTENTION_PARAMS = {
    "Qwen2Attention": ["hidden_size", "num_heads", "num_kv_heads"],
    "LlamaAttention": ["config", "hidden_size", "num_heads", "num_kv_heads"],
}
# Names the attention constructors look up in their module at call time.
TP_GLOBALS = ("get_tensor_model_parallel_world_size", "QKVParallelLinear", "RowParallelLinear")

_swaps = Swaps(NAME)
_logged_layer = False
# ModelConfig's head-count methods only read tensor_parallel_size.
_SINGLE_RANK = SimpleNamespace(tensor_parallel_size=1)


def supported_architecture(model_config) -> bool:
    return any(arch in SUPPORTED for arch in (getattr(model_config, "architectures", None) or []))


def replicates_attention(model_config, parallel_config) -> bool:
    """True when this model's attention runs replicated: TP > 1 and a supported architecture."""
    return (
        model_config is not None
        and parallel_config is not None
        and parallel_config.tensor_parallel_size > 1
        and supported_architecture(model_config)
    )


def check_engine(cfg, vllm_config) -> bool:
    """Refuse an unsupported model (strict); True when this engine's attention is replicated."""
    model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
    if parallel_config.tensor_parallel_size == 1:
        return False
    if not supported_architecture(model_config):
        message = (
            f"rollout_ext patch {NAME!r} supports {', '.join(SUPPORTED)}; model architecture(s) "
            f"{model_config.architectures} would keep sharded attention. "
            f"Set ROLLOUT_EXT_MLP_ONLY_TP=0 for this model."
        )
        if cfg.strict:
            raise PatchError(message)
        logger.warning("rollout_ext: %s Running with sharded attention (ROLLOUT_EXT_STRICT=0).", message)
        return False
    return True


def _building_replicated_model() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return False
    return replicates_attention(vllm_config.model_config, vllm_config.parallel_config)


def _single_rank() -> int:
    return 1


@contextlib.contextmanager
def _tp_disabled(module):
    """Within the block, `module` builds its attention layers as if TP were 1."""
    scoped = Swaps(f"{NAME}:construct")
    scoped.replace(module, "get_tensor_model_parallel_world_size", _single_rank)
    scoped.replace(module, "QKVParallelLinear", functools.partial(module.QKVParallelLinear, disable_tp=True))
    scoped.replace(module, "RowParallelLinear", functools.partial(module.RowParallelLinear, disable_tp=True))
    try:
        yield
    finally:
        scoped.revert()


def _shape(layer) -> tuple[int, ...] | None:
    weight = getattr(layer, "weight", None)
    return tuple(weight.shape) if weight is not None else None


def _log_first_layer(attention) -> None:
    """One line per process, as evidence in engine logs that attention was built replicated."""
    global _logged_layer
    if _logged_layer:
        return
    _logged_layer = True
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    logger.info(
        "rollout_ext %s: %s replicated on tp rank %d of %d: qkv_proj weight %s, o_proj weight %s, "
        "%d query / %d kv heads per rank",
        NAME, getattr(attention.attn, "layer_name", type(attention).__name__),
        get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
        _shape(attention.qkv_proj), _shape(attention.o_proj), attention.num_heads, attention.num_kv_heads,
    )


def _replicated_init(original, module):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not _building_replicated_model():
            return original(self, *args, **kwargs)
        with _tp_disabled(module):
            original(self, *args, **kwargs)
        _log_first_layer(self)

    return __init__


def _per_rank_heads(original):
    @functools.wraps(original)
    def heads(self, parallel_config):
        if replicates_attention(self, parallel_config):
            return original(self, _SINGLE_RANK)
        return original(self, parallel_config)

    return heads


def _require_keyword(func, param: str) -> None:
    if param not in inspect.signature(func).parameters:
        raise PatchError(
            f"rollout_ext patch {NAME!r}: {func.__qualname__} has no {param!r} parameter; "
            f"the upstream code moved and this patch needs updating."
        )


def _attention_targets() -> list[tuple[object, type]]:
    targets = []
    for module_name, class_name in SUPPORTED.values():
        module = importlib.import_module(module_name)
        for name in TP_GLOBALS:
            if not hasattr(module, name):
                raise PatchError(f"rollout_ext patch {NAME!r}: {module_name} no longer imports {name}")
        _require_keyword(module.QKVParallelLinear.__init__, "disable_tp")
        _require_keyword(module.RowParallelLinear.__init__, "disable_tp")
        attention = getattr(module, class_name)
        require_signature(NAME, attention.__init__, ATTENTION_PARAMS[class_name])
        targets.append((module, attention))
    return targets


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    from vllm.config import ModelConfig

    targets = _attention_targets()
    require_vllm_linear_forward(NAME)  # on vllm-ascend, its linears reach it
    require_signature(NAME, ModelConfig.get_num_attention_heads, ["parallel_config"])
    require_signature(NAME, ModelConfig.get_num_kv_heads, ["parallel_config"])
    for module, attention in targets:
        _swaps.replace(attention, "__init__", _replicated_init(attention.__init__, module))
    for method in ("get_num_attention_heads", "get_num_kv_heads"):
        _swaps.replace(ModelConfig, method, _per_rank_heads(getattr(ModelConfig, method)))
    add_compile_key(NAME, _swaps, "v1")
    return ACTIVE


def revert() -> None:
    global _logged_layer
    _swaps.revert()
    _logged_layer = False
