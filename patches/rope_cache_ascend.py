"""rope_cache on vllm-ascend: rotate with the cos/sin its runner already gathers once per step,
instead of gathering them again from the whole table in every layer.

Replaces: vllm_ascend.ops.rotary_embedding.AscendRotaryEmbedding.forward_oot and .__init__
(wrapped), and the name `update_cos_sin` in vllm_ascend.worker.model_runner_v1, which
NPUModelRunner.execute_model calls once per step (wrapped: it records the step's positions).
Why: vllm-ascend (main and 0.23.0) fills per-step buffers `_cos`/`_sin` [1, max_num_batched_tokens,
1, rope_dim] in `update_cos_sin(positions)`: one gather of the step's rows. Yet its plain rope,
AscendRotaryEmbedding.forward_oot -> torch.ops.vllm.npu_rotary_embedding, hands the whole
cos_sin_cache to torch_npu.npu_mrope (main), or to a Triton kernel or _npu_rotary_embedding
(0.23.0), and each of those gathers the same rows again in every layer.
Design (decided): read vllm-ascend's own buffers and rotate with torch_npu.npu_apply_rotary_pos_emb
(BSND, "half"), rather than attach our own step buffer as on stock vLLM, because
- the per-step gather already happens there and is paid: our own buffer would add a second one;
- the buffers are allocated once (set_cos_and_sin), so their addresses are static and graph capture
  reads them like inputs;
- their layout (each angle in both halves, [1, T, 1, D]) is exactly that op's "half" input; it is
  what vllm-ascend's own 310P rope does with them.
A layer takes this path when it is plain neox rope over the whole head (rotary_dim == head_size ==
the buffer's width, head 64 or 128: the op's constraint), its cos_sin_cache is the table
update_cos_sin gathers from (vllm-ascend records the first rope layer's), no offsets or style
override, not an MTP drafter's rope, and the dtypes match. Any other call runs vllm-ascend's path.
Eager: a layer trusts the buffers only for the very positions tensor the runner passed to
update_cos_sin; under torch.compile that check is made at trace time, as on stock vLLM.
Counters: rope_cache's (step_gathers: runner steps that filled the buffers; layer_gathers: calls
that took vllm-ascend's per-layer path; forwards).
Targets: vllm-ascend main 182b75e (run on CPU under the torch_npu emulation) and 0.23.0 (checked
statically against its wheel: the same names, buffers and signatures); vllm>=0.23,<0.28.
Not bound: vllm-ascend's v2 model runner (worker/v2) calls update_cos_sin by its own binding, so
under it every layer keeps vllm-ascend's path (correct, not faster).
Upstream: vllm-ascend's per-step cos/sin buffers (update_cos_sin, get_cos_and_sin_slice).
Undo: revert() restores the three originals. Remove when: vllm-ascend's plain rope reads its own
per-step buffers (then report this module as upstream).
"""

from __future__ import annotations

import functools
import importlib

import torch

from rollout_ext.modules import ACTIVE
from rollout_ext.patches import rope_cache
from rollout_ext.patches._ascend import ascend_label, require_call, require_hook, require_own, require_params
from rollout_ext.patches._base import PatchError, Swaps, require_vllm
from rollout_ext.patches._compile_key import add_compile_key
from rollout_ext.patches._context import get_context, reset_context, set_context
from rollout_ext.patches._counters import define_op

NAME = "rope_cache_ascend"
ROPE_MODULE = "vllm_ascend.ops.rotary_embedding"
RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
STEP_FLAG = "rollout_ext_step_rope"
# The op's head sizes ("half" mode over the whole head).
HEAD_SIZES = (64, 128)

_swaps = Swaps(NAME)
_hooks: dict[str, object] = {}



def _rope_module():
    return _hooks["rope_module"]


def step_eligible(layer) -> bool:
    """Whether `layer` (an AscendRotaryEmbedding) can read the runner's per-step buffers."""
    rope = _rope_module()
    cos = rope._cos
    return (
        cos is not None
        and rope._cos_sin_cache is not None
        and layer.cos_sin_cache is rope._cos_sin_cache
        and layer.is_neox_style
        and layer.rotary_dim == layer.head_size == cos.shape[-1]
        and layer.head_size in HEAD_SIZES
        and not getattr(layer, "use_mtp", False)
    )


def _step_cos_sin(layer, positions, query, key, offsets, is_neox_style_override):
    if not getattr(layer, STEP_FLAG, False) or offsets is not None or key is None:
        return None
    if is_neox_style_override is not None and is_neox_style_override != layer.is_neox_style:
        return None
    rope = _rope_module()
    if query.dtype != rope._cos.dtype or key.dtype != query.dtype:
        return None
    if not torch.compiler.is_compiling() and positions is not get_context().rope_positions:
        return None
    num_tokens = query.shape[0]
    return rope._cos[:, :num_tokens], rope._sin[:, :num_tokens]


def _wrap_forward_oot(original):
    from rollout_ext.ops import npu_available
    from rollout_ext.ops.rotary import apply_rotary_step_npu, apply_rotary_step_reference

    rotate = apply_rotary_step_npu if npu_available() else apply_rotary_step_reference

    @functools.wraps(original)
    def forward_oot(self, positions, query, key, offsets=None, is_neox_style_override=None):
        cos_sin = _step_cos_sin(self, positions, query, key, offsets, is_neox_style_override)
        if cos_sin is None:
            rope_cache.COUNTERS.add("layer_gathers")
            return original(self, positions, query, key, offsets, is_neox_style_override)
        return rotate(query, key, *cos_sin, head_size=self.head_size)

    return forward_oot


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        setattr(self, STEP_FLAG, step_eligible(self))

    return __init__


def _wrap_update(original):
    @functools.wraps(original)
    def update_cos_sin(positions):
        original(positions)
        rope = _rope_module()
        if rope._cos is not None and rope._cos_sin_cache is not None:
            set_context(rope_positions=positions)
            rope_cache.COUNTERS.add("step_gathers")
            rope_cache.COUNTERS.add("forwards")

    return update_cos_sin


def check_upstream():
    """(rope class, rope module, runner module), or PatchError naming the vllm-ascend version and
    the hook that moved."""
    rope_cls = require_hook(NAME, ROPE_MODULE, "AscendRotaryEmbedding")
    for method in ("__init__", "forward_oot"):
        require_own(NAME, rope_cls, method)
    require_params(NAME, rope_cls.forward_oot, ["positions", "query", "key", "offsets", "is_neox_style_override"])
    require_params(NAME, rope_cls.__init__, ["head_size", "rotary_dim", "max_position_embeddings", "base",
                                            "is_neox_style", "dtype"])
    update = require_hook(NAME, ROPE_MODULE, "update_cos_sin")
    require_params(NAME, update, ["positions"])
    rope_module = importlib.import_module(ROPE_MODULE)
    for buffer in ("_cos", "_sin", "_cos_sin_cache"):
        if buffer not in vars(rope_module):
            raise PatchError(f"rollout_ext patch {NAME!r}: {ascend_label()}: {ROPE_MODULE} has no per-step buffer {buffer} "
                             f"(missing hook); the upstream code moved and this binding needs updating")
    require_hook(NAME, RUNNER_MODULE, "NPUModelRunner")
    runner_module = importlib.import_module(RUNNER_MODULE)
    if getattr(runner_module, "update_cos_sin", None) is not update:
        raise PatchError(f"rollout_ext patch {NAME!r}: {ascend_label()}: {RUNNER_MODULE} no longer calls {ROPE_MODULE}.update_cos_sin "
                         f"by that name (missing hook); this binding needs updating")
    execute = require_hook(NAME, RUNNER_MODULE, "NPUModelRunner.execute_model")
    require_call(NAME, execute, "update_cos_sin", "once per step")
    return rope_cls, rope_module, runner_module


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    rope_cls, rope_module, runner_module = check_upstream()
    define_op()
    _hooks["rope_module"] = rope_module
    update = _wrap_update(rope_module.update_cos_sin)
    _swaps.replace(rope_cls, "__init__", _wrap_init(rope_cls.__init__))
    _swaps.replace(rope_cls, "forward_oot", _wrap_forward_oot(rope_cls.forward_oot))
    _swaps.replace(runner_module, "update_cos_sin", update)
    # The compiled graph differs with the patch on: keep vLLM's compile cache keys apart.
    add_compile_key(NAME, _swaps, "v1")
    return ACTIVE


def revert() -> None:
    _swaps.revert()
    _hooks.clear()
    reset_context("rope_positions")
