"""Fixes vLLM's CPU expansion of per-request sampling values, which breaks sampling with drafting.

Replaces: `vllm.utils.cpu_triton_utils.expand_kernel`, the CPU stand-in for the rejection
sampler's Triton `expand_kernel` (vllm/v1/sample/rejection_sampler.py), which the CPU model
runner installs into the rejection sampler at start (vllm/v1/worker/cpu_model_runner.py:115).
Why: `_expand_kernel_impl` (cpu_triton_utils.py:408-421) hands its tensors to the C++ kernel
through `_ensure_int64`, which returns an int64 *copy* of any other dtype. For the float
temperatures the rejection sampler expands per token (`expand_batch_to_tokens(temperature, ...)`)
the input is truncated to an integer and the result lands in a copy that is thrown away, so the
output keeps whatever `new_empty` left in it. Any speculative method then samples at a garbage
temperature whenever temperature > 0 (greedy requests are unaffected). The replacement keeps
the C++ kernel for int64 tensors and expands everything else in plain torch, with the Triton
kernel's semantics (each request's value, `replace_from` mapped to `replace_to`, repeated over
its tokens).
Applies on the CPU platform only. Targets: vllm>=0.23,<0.28 (`_FuncWrapper` with `.func`;
`_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, ...)`).
Upstream: vLLM's CPU backend. Undo: revert(). Remove when vLLM's CPU expand kernel writes its
result back for non-int64 tensors.
"""

from __future__ import annotations

import torch

from rollout_ext.modules import ACTIVE, INERT
from rollout_ext.patches._base import Swaps, require_signature, require_vllm

NAME = "cpu_spec_sampling"
_swaps = Swaps(NAME)


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
           replace_to) -> None:
    """The rejection sampler's expand kernel in plain torch: output[t] = value of t's request."""
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def apply(cfg=None) -> str:
    """Patch on the CPU platform; INERT elsewhere."""
    if _swaps.applied:
        return ACTIVE
    from rollout_ext.platform import device_type

    if device_type() != "cpu":
        return INERT
    require_vllm(NAME)
    from vllm.utils import cpu_triton_utils

    original = cpu_triton_utils.expand_kernel.func
    require_signature(NAME, original, ["output", "input_val", "cu_num_tokens", "replace_from", "replace_to"])

    def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            return original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        return expand(output, input_val, cu_num_tokens, replace_from, replace_to)

    _swaps.replace(cpu_triton_utils, "expand_kernel", cpu_triton_utils._FuncWrapper(expand_kernel_impl))
    return ACTIVE


def revert() -> None:
    _swaps.revert()
