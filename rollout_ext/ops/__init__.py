"""Device-neutral operations: a pure-torch reference beside each NPU implementation.

Each op module (`rotary`, `linear`, `attention`) keeps its pure-torch reference, which runs on
CPU/CUDA and is the definition of correct, next to an NPU path that calls torch_npu. The NPU path
is chosen only when `torch_npu` is importable; torch_npu itself is imported lazily inside the
NPU-only functions, so importing this package never loads it.

No NPU exists where this project is developed. The NPU paths are verified only by (1) binding every
call against the real torch_npu op schema and (2) a pure-torch emulation of each op's documented
math (tests/contract). Real kernels, on-device numerics and HCCL are not verified there.
"""

import functools
import importlib.util


@functools.cache
def npu_available() -> bool:
    """True when torch_npu can be imported. Cached: the answer cannot change within a process."""
    return importlib.util.find_spec("torch_npu") is not None


def reset_npu_cache() -> None:
    """Forget the cached `npu_available()` answer (tests that change sys.path use this)."""
    npu_available.cache_clear()
