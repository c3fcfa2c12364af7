"""The per-step context: state that one model forward's runner step sets and patched layers read.

One object per process: vLLM runs one forward at a time on one thread. It is a plain object, not a
threading.local, so that dynamo can read it while it traces the layer wrappers. Each field belongs
to one patch, which sets it for one forward (`step_context`) or until the next step (`set_context`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch


@dataclass
class Context:
    # rope_cache, rope_cache_ascend: the positions this step's cos/sin rows were gathered for.
    rope_positions: torch.Tensor | None = None
    # flashcomm: the step's token-sharding plan (patches/flashcomm.py Step).
    flashcomm_step: object | None = None


_CONTEXT = Context()
_FIELDS = tuple(f.name for f in fields(Context))


def get_context() -> Context:
    return _CONTEXT


def set_context(**values) -> None:
    for name, value in values.items():
        if name not in _FIELDS:
            raise AttributeError(f"the step context has no field {name!r}; fields: {', '.join(_FIELDS)}")
        setattr(_CONTEXT, name, value)


def reset_context(*names: str) -> None:
    """Clear `names` (every field when none is named)."""
    set_context(**{name: None for name in names or _FIELDS})


@contextlib.contextmanager
def step_context(**values):
    """Set `values` for the forward run inside; restore what was there before on the way out."""
    before = {name: getattr(_CONTEXT, name) for name in values if name in _FIELDS}
    set_context(**values)
    try:
        yield _CONTEXT
    finally:
        set_context(**before)
