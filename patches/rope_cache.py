"""Gathers rope cos/sin once per forward instead of once per decoder layer.

Replaces: vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward (inherited from
CustomOp) and wraps RotaryEmbedding.__init__ and vllm.v1.worker.gpu_model_runner.GPUModelRunner.
_model_forward (CPUModelRunner inherits it).
Why: unpatched, every layer's rotary does `cos_sin_cache.index_select(0, positions)` for the same
positions, so a step gathers the same rows num_layers times. On NPU each gather is a kernel launch
plus a copy; doing it once per step is the rope-cache optimisation vllm-ascend ships in its runner.
Targets: vllm>=0.23,<0.28 (checked against 0.23.0 and 0.27.1 sources; the guarded signatures are
the same in both). Upstream reference: vllm-ascend's model-runner cos/sin cache (its own runner
fills per-step cos/sin buffers before the model runs); written here from scratch for vLLM's runner.

Mechanism (class attribute swaps, not CustomOp.register_oot: register_oot replaces only the class
named "RotaryEmbedding", while Llama3/linear/NTK-scaled ropes are subclasses built by their own
name and share the same forward; a swap covers them and reverts exactly):
- RotaryEmbedding.__init__: after vLLM's init, an eligible instance (its class keeps vLLM's own
  forward_* methods, so its math is the plain rope) gets a non-persistent buffer
  `rollout_ext_step_cos_sin` [max_num_batched_tokens, rotary_dim], one per cos_sin_cache table.
- GPUModelRunner._model_forward: before the model runs, gathers cos/sin rows for the step's
  positions into each distinct table's buffer, outside the compiled graph (one index_select per
  table per forward).
- RotaryEmbedding.forward: a module with a step buffer reads its rows and rotates through
  rollout_ext.ops.rotary (torch_npu kernels on NPU, vLLM's native math elsewhere); any other module
  falls back to vLLM's forward.

Why a persistent buffer and not a Python memo inside the model: vLLM compiles the model forward
with fullgraph=True and drops dynamo guards, so a memo consulted at trace time would be frozen
into the graph and a side-effecting one would leak tensors out of it. A buffer filled outside the
graph is read by the graph as an ordinary input, works the same under eager, torch.compile and
graph capture (static address), and needs no token-count threshold inside compiled code.

Safety: in eager mode a layer uses the buffer only when it rotates the very positions tensor the
runner passed to the model (identity check); otherwise it falls back. Under torch.compile the
decision is made at trace time: every eligible module reads the buffer, which assumes the model
rotates the runner's positions (true for decoder-only models such as Qwen2 and Llama). The patch
stays off (fallback everywhere) when speculative decoding is configured, because get_rope shares
rotary modules between the target and the drafter, which runs other positions.

Counters: `COUNTERS` counts step gathers, per-layer (fallback) gathers and forwards; the fallback
count sits inside the compiled graph, so apply() defines the counting op (patches/_counters.py).

Undo: revert() restores the three originals. Modules built while patched keep their (unused)
buffer; their forward is vLLM's again.
Remove when vLLM gathers rope cos/sin once per forward itself.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._base import Swaps, require_signature, require_vllm
from rollout_ext.patches._context import get_context, step_context
from rollout_ext.patches._counters import Counters, define_op

NAME = "rope_cache"
STEP_BUFFER = "rollout_ext_step_cos_sin"

logger = logging.getLogger("vllm.rollout_ext")
_swaps = Swaps(NAME)
# Gathers into the step buffers, per-layer (fallback) gathers, forwards; shared with rope_cache_ascend.
COUNTERS = Counters("step_gathers", "layer_gathers", "forwards")
_originals: dict[str, object] = {}
# The rotary function used by patched layers; chosen once at apply() so compiled code never asks
# whether torch_npu imports.
_rotate = None

# model -> its modules with a step buffer, found once per model.
_step_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_applied() -> bool:
    return _swaps.applied


# ---------------------------------------------------------------- eligibility and the step


def _rope_class():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding


# Methods whose vLLM versions define the plain rope; a subclass overriding one has other math.
_PLAIN_METHODS = (
    "forward_static", "forward_native", "forward_cuda", "forward_cpu", "forward_oot",
    "forward_xpu", "forward_hip", "_match_cos_sin_cache_dtype",
)


def eligible(module) -> bool:
    """Whether `module` computes vLLM's plain rope from its cos_sin_cache table."""
    base = _rope_class()
    cls = type(module)
    if not isinstance(module, base) or getattr(module, "use_flashinfer", False):
        return False
    if getattr(module, "use_aiter", False):
        return False
    if any(getattr(cls, m, None) is not getattr(base, m, None) for m in _PLAIN_METHODS):
        return False
    table = getattr(module, "cos_sin_cache", None)
    return isinstance(table, torch.Tensor) and table.dim() == 2 and table.shape[-1] == module.rotary_dim


def _step_rows() -> int | None:
    """Rows of a step buffer (the engine's token budget), or None when the patch must stay off."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return None
    if vllm_config.speculative_config is not None:
        logger.warning("rollout_ext rope_cache: speculative decoding is on; leaving rope unpatched")
        return None
    return vllm_config.scheduler_config.max_num_batched_tokens


def attach_step_buffer(module, rows: int) -> bool:
    """Give an eligible rotary module its step buffer; False (and nothing done) otherwise."""
    if not eligible(module):
        return False
    if getattr(module, STEP_BUFFER, None) is None:
        table = module.cos_sin_cache
        buffer = torch.zeros(rows, table.shape[-1], dtype=table.dtype, device=table.device)
        module.register_buffer(STEP_BUFFER, buffer, persistent=False)
    return True


def step_modules(model: torch.nn.Module) -> list:
    """The distinct rotary modules of `model` that read a step buffer (cached per model)."""
    found = _step_modules.get(model)
    if found is None:
        seen: dict[int, object] = {}
        for module in model.modules():
            if getattr(module, STEP_BUFFER, None) is not None:
                seen.setdefault(id(module), module)
        found = list(seen.values())
        _step_modules[model] = found
    return found


def gather_step(modules, positions: torch.Tensor) -> None:
    """Fill each module's step buffer with its own table's rows for `positions` (one gather each)."""
    flat = positions.flatten()
    num_tokens = flat.shape[0]
    for module in modules:
        buffer = getattr(module, STEP_BUFFER)
        if num_tokens > buffer.shape[0]:
            raise RuntimeError(
                f"rollout_ext rope_cache: {num_tokens} tokens in one forward, step buffer holds "
                f"{buffer.shape[0]} (max_num_batched_tokens)"
            )
        torch.index_select(module.cos_sin_cache, 0, flat, out=buffer[:num_tokens])
    COUNTERS.add("step_gathers", len(modules))
    COUNTERS.add("forwards")


@contextlib.contextmanager
def rope_step(model: torch.nn.Module, positions: torch.Tensor | None):
    """Run one forward of `model` with cos/sin gathered once for `positions`."""
    modules = step_modules(model)
    if not modules or positions is None or positions.dim() != 1:
        yield
        return
    gather_step(modules, positions)
    with step_context(rope_positions=positions):
        yield


def _step_cos_sin(module, positions: torch.Tensor):
    """This forward's cos/sin rows for `module`, or None when it must gather itself."""
    buffer = getattr(module, STEP_BUFFER, None)
    if buffer is None:
        return None
    # Under torch.compile this branch is decided at trace time (see the header); in eager mode the
    # buffer is trusted only for the positions the runner gathered it for.
    if not torch.compiler.is_compiling() and positions is not get_context().rope_positions:
        return None
    return buffer[: positions.shape[0]]


# ---------------------------------------------------------------- the replacements


def rope_forward(self, positions, query, key=None):
    cos_sin = _step_cos_sin(self, positions)
    if cos_sin is None:
        COUNTERS.add("layer_gathers")
        return _originals["forward"](self, positions, query, key)
    cos, sin = cos_sin.chunk(2, dim=-1)
    return _rotate(
        query, key, cos, sin, head_size=self.head_size, rotary_dim=self.rotary_dim,
        is_neox=self.is_neox_style, positions=positions, cos_sin_cache=self.cos_sin_cache,
    )


def _rotate_reference(query, key, cos, sin, *, head_size, rotary_dim, is_neox, positions, cos_sin_cache):
    from rollout_ext.ops.rotary import apply_rotary_reference

    return apply_rotary_reference(
        query, key, cos, sin, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox
    )


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        rows = _step_rows()
        if rows:
            attach_step_buffer(self, rows)

    return __init__


def _wrap_model_forward(original):
    @functools.wraps(original)
    def _model_forward(self, *args, **kwargs):
        positions = kwargs["positions"] if "positions" in kwargs else (args[1] if len(args) > 1 else None)
        with rope_step(self.model, positions):
            return original(self, *args, **kwargs)

    return _model_forward


def check_upstream(rope, runner) -> None:
    """Raise PatchError when the methods this patch replaces or mirrors have moved."""
    require_signature(
        NAME, rope.__init__,
        ["head_size", "rotary_dim", "max_position_embeddings", "base", "is_neox_style", "dtype"],
    )
    require_signature(NAME, rope.forward_native, ["positions", "query", "key"])
    require_signature(
        NAME, rope.forward_static,
        ["positions", "query", "key", "head_size", "rotary_dim", "cos_sin_cache", "is_neox_style"],
    )
    require_signature(
        NAME, runner._model_forward, ["input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
    )


def apply(cfg) -> str:
    global _rotate
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from rollout_ext.ops import npu_available
    from rollout_ext.ops.rotary import apply_rotary_npu
    from rollout_ext.patches._compile_key import add_compile_key

    rope = _rope_class()
    check_upstream(rope, GPUModelRunner)
    define_op()
    _rotate = apply_rotary_npu if npu_available() else _rotate_reference
    _originals["forward"] = _swaps.replace(rope, "forward", rope_forward)
    _originals["__init__"] = _swaps.replace(rope, "__init__", _wrap_init(rope.__init__))
    _originals["_model_forward"] = _swaps.replace(
        GPUModelRunner, "_model_forward", _wrap_model_forward(GPUModelRunner._model_forward)
    )
    # The compiled graph differs with the patch on: keep vLLM's compile cache keys apart.
    add_compile_key(NAME, _swaps, "v1")
    return ACTIVE


def revert() -> None:
    global _rotate
    _swaps.revert()
    _originals.clear()
    _rotate = None
