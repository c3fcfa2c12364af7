"""Counters: the named event counts a patch keeps in this process, read by tests, `check` and benches.

Every patch counts the same way: `COUNTERS = Counters("a", "b")`, `COUNTERS.add("a")` where the
event happens, `COUNTERS.read()` / `COUNTERS.reset()` outside. An add in eager code is a Python
integer add under a lock (vLLM's layers run on one thread, the tests' emulated ranks on several).
An add inside code that torch.compile traces goes through one custom op that bumps a tensor, because
a Python `+=` there would run once, at trace time, and never again; a patch whose counts can be
traced calls `define_op()` in its apply().
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_op_defined = False


def define_op() -> None:
    """Define the counting op (idempotent). Not at import: importing a patch registers nothing."""
    global _op_defined
    if _op_defined:
        return

    @torch.library.custom_op("rollout_ext::count", mutates_args=("counts",))
    def count(counts: torch.Tensor, slot: int, amount: int) -> None:
        with _lock:
            counts[slot] += amount

    _op_defined = True


class Counters:
    def __init__(self, *names: str):
        self.names = names
        self._eager = [0] * len(names)
        self._traced = torch.zeros(len(names), dtype=torch.int64)

    def add(self, name: str, amount: int = 1) -> None:
        slot = self.names.index(name)
        if torch.compiler.is_compiling():
            torch.ops.rollout_ext.count(self._traced, slot, amount)
            return
        with _lock:
            self._eager[slot] += amount

    def read(self) -> dict[str, int]:
        with _lock:
            return {name: self._eager[i] + int(self._traced[i]) for i, name in enumerate(self.names)}

    def reset(self) -> None:
        with _lock:
            self._eager = [0] * len(self.names)
            self._traced.zero_()
