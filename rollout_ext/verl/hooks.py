"""Run a callback right after a module is imported, or now if it already is.

verl's registries and the functions our verl-side patches wrap live in modules that pull in Ray,
pydantic or vLLM. Registration happens during `import verl`, when none of them is loaded yet, so
we wait for each module to be imported by verl itself instead of importing it early. The callback
runs after the module body and before the importer gets the module back, so even
`from module import name` in the importer sees the patched name.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

Callback = Callable[[object], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}


def when_imported(module_name: str, callback: Callback) -> None:
    """Call callback(module) once `module_name` is imported (immediately when it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _pending.setdefault(module_name, []).append(callback)
            _install_finder()
            return
    callback(module)


def pending_modules() -> list[str]:
    with _lock:
        return sorted(_pending)


def _install_finder() -> None:
    if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _run_callbacks(module_name: str, module) -> None:
    with _lock:
        callbacks = _pending.pop(module_name, [])
    for callback in callbacks:
        callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it asks the other finders and wraps the loader they return."""

    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner, module_name: str):
        self._inner = inner
        self._module_name = module_name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        # The module's own __loader__ stays the real loader (source lookups, pickling by reference).
        module.__loader__ = self._inner
        self._inner.exec_module(module)
        _run_callbacks(self._module_name, module)

    def __getattr__(self, name):
        return getattr(self._inner, name)
