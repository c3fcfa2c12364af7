"""mc2 on vllm-ascend: AscendRowParallelLinear's matmul + all-reduce through the same dispatch as on
stock vLLM (`torch.ops.rollout_ext.mc2_row_parallel`, MC2 from the prefill threshold up).

Replaces: vllm_ascend.ops.linear.AscendRowParallelLinear.forward (wrapped) and .__init__ (wrapped,
to make each layer reachable from the custom op by its prefix).
Why: vllm-ascend registers AscendRowParallelLinear as "RowParallelLinear" from its NPUWorker, after
the plugins load, so the stock mc2 patch's registration is overwritten there and never engages. On
vllm-ascend main a dense model's o_proj and down_proj get no custom op (`self.custom_op is None`)
and run vLLM's matmul, then a separate HCCL all-reduce; main removed vllm-ascend's own MC2
(MatmulAllreduceRowParallelOp, PR #12119). This binding takes exactly those layers: unquantized,
reduce_results, input already parallel, TP > 1, no vllm-ascend custom op. A layer that has one
(MLP/O-proj TP, and on 0.23.0 its own MatmulAllreduce or flashcomm1 ops when switched on there) is
left to vllm-ascend.
0.23.0: vllm-ascend's own op (VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE) fuses every row-parallel call,
decode included, and caches one HCCL communicator name per process. We use ours there too: it fuses
only prefill-sized steps (the op's documented use) and resolves the name per process group.
Targets: vllm-ascend main 182b75e (checked on CPU under the torch_npu emulation: two emulated HCCL
ranks) and 0.23.0 (checked statically against the release wheel: same class, same
`forward(self, input_, **kwargs)` and `custom_op` attribute); vllm>=0.23,<0.28.
Upstream: vllm-ascend 0.23.0 MatmulAllreduceRowParallelOp (removed on main).
Undo: revert() restores both methods and the compile-hash wrapper; layers built while applied keep
their (unused) `_mc2_key`.
Remove when: vllm-ascend ships an MC2 row-parallel path for dense models again.
"""

from __future__ import annotations

import functools

from rollout_ext.modules import ACTIVE
from rollout_ext.patches import mc2_row_parallel as mc2
from rollout_ext.patches._ascend import require_hook, require_own, require_params
from rollout_ext.patches._base import Swaps, require_vllm
from rollout_ext.patches._compile_key import add_compile_key

NAME = "mc2_ascend"
LINEAR_MODULE = "vllm_ascend.ops.linear"
LAYER_CLASS = "AscendRowParallelLinear"

_swaps = Swaps(NAME)


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        mc2.track(self)

    return __init__


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, input_, **kwargs):
        if getattr(self, "custom_op", None) is None and mc2.takes_over(self):
            return mc2.forward_through_op(self, input_)
        return original(self, input_, **kwargs)

    return forward


def check_upstream():
    """The class this binding hooks, or PatchError naming the vllm-ascend version and the hook."""
    layer_cls = require_hook(NAME, LINEAR_MODULE, LAYER_CLASS)
    for method in ("__init__", "forward"):
        require_own(NAME, layer_cls, method)
    require_params(NAME, layer_cls.forward, ["input_"])
    require_params(NAME, layer_cls.__init__, ["input_size", "output_size", "bias", "input_is_parallel"])
    return layer_cls


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    layer_cls = check_upstream()
    mc2.enable(cfg.mc2_min_tokens)
    _swaps.replace(layer_cls, "__init__", _wrap_init(layer_cls.__init__))
    _swaps.replace(layer_cls, "forward", _wrap_forward(layer_cls.forward))
    add_compile_key(NAME, _swaps, f"min_tokens={cfg.mc2_min_tokens}")
    return ACTIVE


def revert() -> None:
    _swaps.revert()
