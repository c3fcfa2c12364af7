"""Replaces vLLM's RowParallelLinear matmul + all-reduce with one dispatch that can use MC2.

What: vllm.model_executor.layers.linear.RowParallelLinear.forward, for unquantized layers with
TP > 1, reduce_results=True and an already-parallel input (o_proj, down_proj). The matmul and the
all-reduce go through the custom op `torch.ops.rollout_ext.mc2_row_parallel`, which decides AT RUN
TIME, per call, with `ops.linear.mc2_eligible` (fp16/bf16, TP 2/4/8, tokens >= min_tokens):
  eligible     -> `ops.linear.matmul_all_reduce(..., fused=True)`: one MC2 kernel on NPU
                  (torch_npu.npu_mm_all_reduce_base), matmul then all-reduce elsewhere;
  not eligible -> exactly vLLM's path: quant_method.apply (bias on rank 0) + TP all-reduce.
Quantized layers, TP=1, reduce_results=False and split inputs keep vLLM's forward untouched.
Why: on Ascend the fused kernel overlaps the matmul with the HCCL all-reduce (prefill-heavy steps).

Compile: vLLM drops dynamo guards, so a Python `if num_tokens >= min_tokens` in forward would be
frozen at trace time. The decision therefore lives inside a torch.library custom op, which is
opaque to dynamo/inductor and runs its Python body on every call (the counters below prove it).
`compile_ranges_endpoints` was not used: it compiles one FX graph per token range, but the graph
comes from a single dynamo trace, so it cannot change what Python branches were taken.
The compile cache key gets this patch's settings mixed in (`_compile_key`), so graphs compiled
with the patch off are never reused with it on, and the other way round.

CPU note: vLLM's CPU backend repacks unquantized weights for oneDNN and leaves `layer.weight`
empty, and the test models are fp32, so on CPU `mc2_eligible` is False and every call takes the
vLLM path inside the op. The fused branch is exercised on CPU only in-process (bf16, unpacked).

Mechanism: vLLM's own extension point, `PluggableLayer.register_oot` under the name
"RowParallelLinear" (vLLM 0.23 and 0.27 both make RowParallelLinear a PluggableLayer): new layers
are instantiated as a subclass of whatever class was registered before (vLLM's, or a platform
plugin's). Layers built before apply() are not changed.
Targets: vllm>=0.23,<0.28 (RowParallelLinear.forward(self, input_); attributes tp_rank, tp_size,
reduce_results, input_is_parallel, skip_bias_add, return_bias, quant_method, prefix).
Upstream: vllm-ascend's matmul-allreduce RowParallelLinear (removed there), torch_npu MC2 docs.
Undo: revert() restores the previous registry entry and the compile-hash wrapper.
Remove when vLLM fuses RowParallelLinear's matmul and all-reduce for large steps itself.
"""

from __future__ import annotations

import logging
import weakref

import torch

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._base import PatchError, Swaps, require_signature, require_vllm
from rollout_ext.patches._compile_key import add_compile_key
from rollout_ext.patches._counters import Counters

NAME = "mc2_row_parallel"
LAYER_NAME = "RowParallelLinear"
OP_NAME = "rollout_ext::mc2_row_parallel"
logger = logging.getLogger("vllm.rollout_ext")

_swaps = Swaps(NAME)
_state: dict = {"applied": False, "previous": None, "min_tokens": None}
# prefix -> weak reference to the layer; the custom op takes the prefix (ops cannot take modules).
_layers: dict[str, weakref.ref] = {}
# Calls through the dispatch in this process, and how many took the fused path.
COUNTERS = Counters("calls", "fused")
_op_defined = False


def _record(fused: bool, num_tokens: int) -> None:
    COUNTERS.add("calls")
    COUNTERS.add("fused", int(fused))
    counts = COUNTERS.read()
    calls, fused_calls = counts["calls"], counts["fused"]
    # Powers of two: the log shows the dispatch keeps running without one line per call.
    if calls & (calls - 1) == 0:
        logger.info(
            "rollout_ext mc2_row_parallel: %d row-parallel calls dispatched, %d fused "
            "(last: %d tokens, min_tokens=%d)",
            calls, fused_calls, num_tokens, _state["min_tokens"] or 0,
        )


def is_quantized(layer) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return not isinstance(layer.quant_method, UnquantizedLinearMethod)


def takes_over(layer) -> bool:
    """Whether this layer's forward goes through the dispatch (decided per layer, not per call)."""
    return layer.reduce_results and layer.tp_size > 1 and layer.input_is_parallel and not is_quantized(layer)


def dispatch(layer, x: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """Matmul + TP all-reduce of one row-parallel layer; MC2 when `mc2_eligible` says so."""
    from vllm.distributed import get_tp_group

    from rollout_ext.ops.linear import matmul_all_reduce, mc2_eligible

    group = get_tp_group()
    bias = None if layer.skip_bias_add else layer.bias
    num_tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fused = mc2_eligible(x, layer.weight, tp_size=group.world_size, min_tokens=min_tokens, quantized=False)
    _record(fused, num_tokens)
    if fused:
        return matmul_all_reduce(x, layer.weight, bias, group, fused=True)
    # The reduction sums the bias, so only rank 0 adds it (as vLLM does).
    rank_bias = bias if layer.tp_rank == 0 else None
    return group.all_reduce(layer.quant_method.apply(layer, x, rank_bias))


def _lookup(layer_name: str):
    ref = _layers.get(layer_name)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(f"rollout_ext {NAME}: no live RowParallelLinear registered as {layer_name!r}")
    return layer


def _define_op() -> None:
    """Register the custom op once per process (torch.library ops cannot be unregistered)."""
    global _op_defined
    if _op_defined:
        return

    @torch.library.custom_op(OP_NAME, mutates_args=())
    def mc2_row_parallel(x: torch.Tensor, layer_name: str, min_tokens: int) -> torch.Tensor:
        return dispatch(_lookup(layer_name), x, min_tokens)

    @mc2_row_parallel.register_fake
    def _(x: torch.Tensor, layer_name: str, min_tokens: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], _lookup(layer_name).output_size))

    _op_defined = True


def track(layer) -> None:
    """Make `layer` reachable from the custom op. Keyed by prefix, as vLLM keys attention layers:
    stable across processes, so a cached compiled graph that names a layer finds it again."""
    layer._mc2_key = layer.prefix or f"<unnamed {id(layer)}>"
    _layers[layer._mc2_key] = weakref.ref(layer)


def forward_through_op(layer, input_):
    """The layer's forward with matmul + all-reduce in the custom op (the layer must take_over)."""
    output = torch.ops.rollout_ext.mc2_row_parallel(input_, layer._mc2_key, _state["min_tokens"])
    if not layer.return_bias:
        return output
    return output, (layer.bias if layer.skip_bias_add else None)


def enable(min_tokens: int) -> None:
    """Define the op and set its token threshold (shared by this patch and mc2_ascend)."""
    _define_op()
    _state["min_tokens"] = min_tokens


def make_layer_class(base: type) -> type:
    """A subclass of `base` whose forward sends eligible layers through the custom op."""

    class Mc2RowParallelLinear(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            track(self)

        def forward(self, input_):
            if not takes_over(self):
                return super().forward(input_)
            return forward_through_op(self, input_)

    Mc2RowParallelLinear.__qualname__ = f"Mc2{base.__qualname__}"
    return Mc2RowParallelLinear


def check_upstream(row_cls: type, pluggable_cls: type) -> None:
    """Raise PatchError when RowParallelLinear no longer looks the way this patch expects."""
    if not issubclass(row_cls, pluggable_cls):
        raise PatchError(f"rollout_ext patch {NAME!r}: {row_cls.__qualname__} is no PluggableLayer in this vLLM")
    require_signature(NAME, row_cls.forward, ["input_"])
    require_signature(NAME, row_cls.__init__, ["input_size", "output_size", "bias", "input_is_parallel"])


def apply(cfg) -> str:
    if _state["applied"]:
        return ACTIVE
    require_vllm(NAME)
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.linear import RowParallelLinear

    check_upstream(RowParallelLinear, PluggableLayer)
    enable(cfg.mc2_min_tokens)
    previous = op_registry_oot.pop(LAYER_NAME, None)
    layer_cls = make_layer_class(previous or RowParallelLinear)
    RowParallelLinear.register_oot(layer_cls, name=LAYER_NAME)
    add_compile_key(NAME, _swaps, f"min_tokens={cfg.mc2_min_tokens}")
    _state.update(applied=True, previous=previous, min_tokens=cfg.mc2_min_tokens)
    return ACTIVE


def revert() -> None:
    if not _state["applied"]:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    op_registry_oot.pop(LAYER_NAME, None)
    if _state["previous"] is not None:
        op_registry_oot[LAYER_NAME] = _state["previous"]
    _swaps.revert()
    _state.update(applied=False, previous=None, min_tokens=None)
