"""Imports vllm-ascend's platform and worker patches before any rollout_ext patch touches vLLM.

Replaces: the hand edit users make in verl's fsdp_workers.py (`import vllm_ascend.patch.worker`),
which exists because vllm-ascend's worker patches must run before other code binds vLLM symbols
(a `from vllm... import X` made earlier keeps the unpatched X).
Why: the plugin's register() is the first rollout_ext code in every vLLM process, and this patch
is first in the registry, so vllm-ascend's patches land before ours in every process.
Targets: any vLLM; a no-op when vllm_ascend is not importable. Upstream: vllm-ascend's
vllm_ascend/patch/{platform,worker}. Undo: revert() forgets the record; imported modules stay
imported (Python cannot un-import, and vllm-ascend's patches have no undo).
Remove when vllm-ascend applies its worker patches before other general plugins load.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from rollout_ext.modules import ACTIVE, INERT
from rollout_ext.patches._base import PatchError

NAME = "ascend_import_order"
ASCEND_PATCH_MODULES = ("vllm_ascend.patch.platform", "vllm_ascend.patch.worker")
logger = logging.getLogger("vllm.rollout_ext")

_imported: list[str] = []


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def apply(cfg=None) -> str:
    """Import vllm-ascend's patch modules, platform first (`imported()` lists them). Inert where
    vllm_ascend is not importable."""
    if _imported:
        return ACTIVE
    if not _importable("vllm_ascend"):
        return INERT
    for module in ASCEND_PATCH_MODULES:
        if _importable(module):
            try:
                importlib.import_module(module)
            except Exception as e:
                # A PatchError lets ROLLOUT_EXT_STRICT=0 log and go on; strict mode still fails the start.
                raise PatchError(f"rollout_ext patch {NAME!r}: importing {module} failed: {e!r}") from e
            _imported.append(module)
        else:
            logger.warning("rollout_ext: vllm_ascend is installed but has no %s; skipped", module)
    logger.info("rollout_ext %s: imported %s first", NAME, ", ".join(_imported) or "nothing")
    return ACTIVE


def revert() -> None:
    _imported.clear()


def imported() -> list[str]:
    return list(_imported)
