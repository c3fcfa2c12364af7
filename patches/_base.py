"""What every patch shares: the vLLM version guard, the signature check, and reversible swaps."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rollout_ext.modules import ACTIVE
from rollout_ext.platform import vllm_version

logger = logging.getLogger("rollout_ext")

# vllm-ascend 0.23 pairs with vLLM 0.23; vllm-ascend main targets 0.27. CI runs 0.27.1 only.
SUPPORTED_VLLM = ">=0.23,<0.28"


class PatchError(RuntimeError):
    """A patch cannot be applied to the installed vLLM."""


def require_vllm(patch: str, spec: str = SUPPORTED_VLLM, version: Version | None = None) -> Version:
    version = version or vllm_version()
    if version is None:
        raise PatchError(f"rollout_ext patch {patch!r}: vLLM is not installed")
    if version not in SpecifierSet(spec):
        raise PatchError(
            f"rollout_ext patch {patch!r} supports vllm{spec}; found vllm {version}. "
            f"Install a supported vLLM, or switch the module off."
        )
    return version


def require_signature(patch: str, func, params: list[str], upstream: str | None = None) -> None:
    """Fail when upstream renamed or reordered the parameters our replacement relies on.
    `upstream` names the code's version in the message (default: the installed vLLM)."""
    found = [p for p in inspect.signature(func).parameters if p != "self"]
    if found[: len(params)] != params:
        raise PatchError(
            f"rollout_ext patch {patch!r}: {func.__qualname__} has parameters {found}, expected {params} "
            f"({upstream or f'vllm {vllm_version()}'}). The upstream code moved; this patch needs updating."
        )


_MISSING = object()


class Swaps:
    """Attribute replacements that can be undone exactly, in reverse order."""

    def __init__(self, patch: str):
        self.patch = patch
        self._saved: list[tuple[object, str, object]] = []

    @property
    def applied(self) -> bool:
        return bool(self._saved)

    def replace(self, owner, attr: str, new) -> object:
        """Set owner.attr = new; return what was visible before (inherited or own)."""
        visible = getattr(owner, attr)
        own = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        self._saved.append((owner, attr, own))
        setattr(owner, attr, new)
        return visible

    def revert(self) -> None:
        while self._saved:
            owner, attr, own = self._saved.pop()
            if own is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


class Wrap:
    """A patch that replaces one function with a wrapper of it: the apply/guard/undo every
    single-site patch shares. `owner` is a module path, `attr` a name in it ("func" or
    "Class.method"); `make(original)` returns the replacement; `guard(name, original)` raises when
    upstream moved. The patch file's own apply() and revert() are this object's."""

    def __init__(self, name: str, owner: str, attr: str, make, guard):
        self.name, self.owner, self.attr, self.make, self.guard = name, owner, attr, make, guard
        self._swaps = Swaps(name)

    @property
    def applied(self) -> bool:
        return self._swaps.applied

    def apply(self, cfg=None) -> str:
        if self._swaps.applied:
            return ACTIVE
        holder = importlib.import_module(self.owner)
        *path, leaf = self.attr.split(".")
        for part in path:
            holder = getattr(holder, part)
        original = getattr(holder, leaf)
        self.guard(self.name, original)
        self._swaps.replace(holder, leaf, functools.wraps(original)(self.make(original)))
        return ACTIVE

    def revert(self) -> None:
        self._swaps.revert()
