"""Keeps each linear layer's unpacked weight on vLLM's CPU backend, so that a weight sync can load into it.

Replaces: `vllm.model_executor.layers.linear.UnquantizedLinearMethod.process_weights_after_loading`
(linear.py:216-220), whose CPU branch calls `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`,
with the same call and `remove_weight=False`.
Why: after loading, the CPU backend packs every linear weight for oneDNN (or sgl-kernel, zentorch)
and replaces `layer.weight` with an empty Parameter. verl's weight sync then calls
`model.load_weights` (verl/workers/rollout/vllm_rollout/utils.py:405), which fails with
"'Parameter' object has no attribute 'weight_loader'" (vllm linear.py:1417). With the weight kept,
the sync writes into it, and verl re-runs `process_weights_after_loading` after every sync
(utils.py:353), which packs the new values.
Cost: one more copy of every linear weight in each replica. So it applies only on the CPU platform and
only when the replica's weights are synced from a trainer (ROLLOUT_EXT_WEIGHT_SYNC=1, which
rollout_ext's verl replica sets for hybrid and colocated rollouts); elsewhere apply() does nothing.
Targets: vllm>=0.23,<0.28 (process_weights_after_loading(self, layer); dispatch_cpu_unquantized_gemm
(layer, remove_weight)). Upstream: vLLM's CPU backend. Undo: revert(). Remove when vLLM's CPU
backend keeps a reloadable weight.
"""

from __future__ import annotations

import functools
import logging

from rollout_ext.modules import ACTIVE, INERT
from rollout_ext.patches._base import Swaps, require_signature, require_vllm

NAME = "cpu_weight_reload"
logger = logging.getLogger("vllm.rollout_ext")
_swaps = Swaps(NAME)


def wanted(cfg) -> bool:
    from rollout_ext.platform import device_type

    return cfg.weight_sync and device_type() == "cpu"


def apply(cfg) -> str:
    """Patch when `wanted(cfg)`; INERT otherwise."""
    if _swaps.applied:
        return ACTIVE
    if not wanted(cfg):
        return INERT
    require_vllm(NAME)
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading
    require_signature(NAME, original, ["layer"])
    require_signature(NAME, layer_utils.dispatch_cpu_unquantized_gemm, ["layer", "remove_weight"])

    @functools.wraps(original)
    def process_weights_after_loading(self, layer) -> None:
        # The same call as vLLM's CPU branch (applied on CPU only), keeping the weight.
        layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    _swaps.replace(UnquantizedLinearMethod, "process_weights_after_loading", process_weights_after_loading)
    logger.info("rollout_ext %s: CPU linear layers keep their weights for weight sync", NAME)
    return ACTIVE


def revert() -> None:
    _swaps.revert()
