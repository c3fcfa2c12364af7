"""patches/cpu_spec_sampling.py: vLLM's CPU expand kernel, as the rejection sampler calls it for
temperatures, against the Triton kernel's semantics; the unpatched function is the control."""

from __future__ import annotations

import torch

from rollout_ext.patches import cpu_spec_sampling


def _reference(values, cu, replace_from, replace_to):
    """The Triton expand_kernel, request by request (vllm/v1/sample/rejection_sampler.py)."""
    out, start = [], 0
    for value, end in zip(values.tolist(), cu.tolist()):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


def _expand(kernel, x, cu):
    # As expand_batch_to_tokens calls it: new_empty output, one value per request.
    out = x.new_empty(int(cu[-1]))
    out.fill_(-7)  # what new_empty may leave; a kernel that never writes leaves it
    kernel[(x.shape[0],)](out, x, cu, 0, 0, MAX_NUM_TOKENS=8)
    return out


def test_float_temperatures_expand_per_token_only_with_the_patch():
    import vllm._C  # noqa: F401 -- registers the CPU kernels (torch.ops._C), as the CPU worker does
    from vllm.utils import cpu_triton_utils

    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3], dtype=torch.float32)
    cu = torch.tensor([3, 4, 6, 9], dtype=torch.int32)
    want = torch.tensor(_reference(temperature, cu, 0, 0), dtype=torch.float32)
    # Control: vLLM's own CPU kernel loses the result (and would truncate 0.7 to 0 on the way).
    broken = _expand(cpu_triton_utils.expand_kernel, temperature, cu)
    assert not torch.equal(broken, want), broken
    assert cpu_spec_sampling.apply() == "active"
    try:
        fixed = _expand(cpu_triton_utils.expand_kernel, temperature, cu)
        torch.testing.assert_close(fixed, want, rtol=0, atol=0)
        # int64 keeps vLLM's C++ kernel (its only correct case), replace_from -> replace_to included.
        ids = torch.tensor([5, 0, 9], dtype=torch.int64)
        cu64 = torch.tensor([2, 3, 5], dtype=torch.int64)
        out = ids.new_empty(5)
        cpu_triton_utils.expand_kernel[(3,)](out, ids, cu64, 0, 11, MAX_NUM_TOKENS=8)
        assert out.tolist() == _reference(ids, cu64, 0, 11) == [5, 5, 11, 9, 9]
    finally:
        cpu_spec_sampling.revert()
    assert not torch.equal(_expand(cpu_triton_utils.expand_kernel, temperature, cu), want)
