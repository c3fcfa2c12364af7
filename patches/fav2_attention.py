"""Routes prefill attention through the ATB FlashAttention-v2 op (NPU only).

Replaces: `vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl._forward_prefill_no_cache`
(the whole-prompt prefill path of vllm-ascend's attention backend, state PrefillNoCache) with a call
to `rollout_ext.ops.attention.prefill_attention`, whose NPU path is
`torch_npu.atb._npu_flash_attention_v2(..., mask_type=1, seq_len=<host list of ints>)`. The op's
default mask_type=2 is ALiBi, and a device tensor for seq_len is wrong; ops/attention.py handles both
and is contract-tested against the op schema there.
Why: FAV2 measured faster than the default prefill kernel for long rollout prompts when chunked
prefill is off (the config refuses FAV2 with chunked prefill: the kernel takes whole prompts).
Devices: on anything but an Ascend NPU with torch_npu, and on an NPU without vllm-ascend, apply()
raises PatchError naming this patch and the device (in strict mode that fails the engine start).
vllm-ascend 0.23.0 and main have no `_forward_prefill_no_cache`: their prefill goes through
`forward_fused_infer_attention` (npu_fused_infer_attention_score over paged KV in TND layout), which
this whole-prompt kernel cannot replace safely, so there the patch refuses, naming the vllm-ascend
version (checked on CPU against main's source under the torch_npu emulation, and statically
against the 0.23.0 wheel).
Verification: only the refusals run where this project is developed (CPU). The vllm-ascend hook has
never run here: it is written against vllm-ascend's attention_v1.py (the v0.11-era layout, where
`_forward_prefill_no_cache(self, query, key, value, attn_metadata, output, num_tokens)` receives
[T, heads, head_size] tensors and host `attn_metadata.seq_lens`); the signature guard refuses other
layouts rather than guess.
Mechanism: class attribute swap (vllm-ascend's impl is not a CustomOp). Eager and graph mode alike:
the swapped method runs where the original ran.
Targets: vllm>=0.23,<0.28 with a matching vllm-ascend. Upstream: vllm-ascend attention_v1.py.
Undo: revert().
Remove when vllm-ascend's own prefill kernel matches FAV2 on long rollout prompts.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._ascend import require_hook
from rollout_ext.patches._base import PatchError, Swaps, require_signature, require_vllm

NAME = "fav2_attention"
ASCEND_ATTENTION = "vllm_ascend.attention.attention_v1"
ASCEND_IMPL = "AscendAttentionBackendImpl"
PREFILL_METHOD = "_forward_prefill_no_cache"
PREFILL_PARAMS = ["query", "key", "value", "attn_metadata", "output"]
logger = logging.getLogger("vllm.rollout_ext")

_swaps = Swaps(NAME)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def require_npu() -> None:
    """Refuse clearly unless the ATB flash-attention op can exist in this process."""
    from rollout_ext.ops.attention import fav2_supported
    from rollout_ext.platform import device_type

    if not fav2_supported():
        raise PatchError(
            f"rollout_ext patch {NAME!r}: device is {device_type()}, but FAV2 "
            "(torch_npu.atb._npu_flash_attention_v2) is NPU-only. Set ROLLOUT_EXT_FAV2=0 on this device."
        )
    if not _has_module("vllm_ascend"):
        raise PatchError(
            f"rollout_ext patch {NAME!r}: device is npu, but vllm_ascend is not installed; FAV2 hooks "
            "vllm-ascend's attention backend. Install vllm-ascend or set ROLLOUT_EXT_FAV2=0."
        )


def _fav2_prefill(original):
    @functools.wraps(original)
    def prefill(self, query, key, value, attn_metadata, output=None, num_tokens=0, *args, **kwargs):
        from rollout_ext.ops.attention import prefill_attention

        seq_lens = attn_metadata.seq_lens
        num_tokens = num_tokens or query.shape[0]
        result = prefill_attention(
            query[:num_tokens], key[:num_tokens], value[:num_tokens],
            seq_lens=seq_lens.tolist() if hasattr(seq_lens, "tolist") else list(seq_lens),
            scale=self.scale, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )
        if output is None:
            return result
        output[:num_tokens].copy_(result.reshape(output[:num_tokens].shape))
        return output[:num_tokens]

    return prefill


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    require_npu()
    original = require_hook(NAME, ASCEND_ATTENTION, f"{ASCEND_IMPL}.{PREFILL_METHOD}")
    require_signature(NAME, original, PREFILL_PARAMS)
    impl = require_hook(NAME, ASCEND_ATTENTION, ASCEND_IMPL)
    _swaps.replace(impl, PREFILL_METHOD, _fav2_prefill(original))
    logger.info("rollout_ext %s: %s.%s routed to ATB FAV2", NAME, ASCEND_IMPL, PREFILL_METHOD)
    return ACTIVE


def revert() -> None:
    _swaps.revert()
