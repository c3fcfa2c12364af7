"""Makes vLLM's torch.compile cache key depend on which graph-changing rollout_ext patches are on.

Why: vLLM keys its compile cache (and its AOT-compiled model artifacts, on by default in 0.27) on
`VllmConfig.compute_hash()`, the vLLM env vars and the traced source files. The ROLLOUT_EXT_*
switches are in none of them, so a run with a patch on could load a graph compiled by a run with it
off (and the other way round) from a shared VLLM_CACHE_ROOT, and the patch would silently do nothing.
Mixing a short fingerprint of the patch and its settings into `compute_hash` keeps the two apart.

Targets: vllm>=0.23,<0.28 (`VllmConfig.compute_hash(self) -> str`). Mechanism: wrap the method
through the calling patch's `Swaps`, so that patch's `revert()` removes it too.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

from rollout_ext.patches._base import PatchError


def add_compile_key(patch: str, swaps, fingerprint: str) -> None:
    """Wrap VllmConfig.compute_hash so its result also depends on `patch` and `fingerprint`."""
    from vllm.config import VllmConfig

    original = VllmConfig.compute_hash
    params = [p for p in inspect.signature(original).parameters if p != "self"]
    if params:
        raise PatchError(
            f"rollout_ext patch {patch!r}: VllmConfig.compute_hash takes {params}, expected no "
            f"arguments; the upstream code moved"
        )
    salt = f"rollout_ext:{patch}:{fingerprint}"

    @functools.wraps(original)
    def compute_hash(self) -> str:
        mixed = f"{original(self)}|{salt}".encode()
        return hashlib.sha256(mixed).hexdigest()[:10]

    swaps.replace(VllmConfig, "compute_hash", compute_hash)
