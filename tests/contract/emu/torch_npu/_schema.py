"""Binds emulated-op calls against the real torch_npu 2.14 schemas (tests/contract/*.schemas).

Every emulated op first goes through `bind`: positional count, argument names, keyword-only
arguments, defaults, unknown or duplicated keywords and basic argument types, the way the real
dispatcher would reject them. Only then does the emulation compute.
"""

import functools
import pathlib

import torch

SCHEMA_FILE = pathlib.Path(__file__).resolve().parents[2] / "torch_npu_2.14.schemas"

# Every call made through an emulated op, in order: (op name, bound arguments).
CALLS: list[tuple[str, dict]] = []


@functools.cache
def schemas() -> dict:
    parsed = {}
    for line in SCHEMA_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            schema = torch._C.parse_schema(line)
            parsed[schema.name] = schema
    return parsed


def _check_type(op: str, arg, value) -> None:
    kind = str(arg.type)
    optional = kind.startswith("Optional[")
    if optional and value is None:
        return
    base = kind[len("Optional["):-1] if optional else kind
    ok = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        # SymInt[] / int[] are host lists; a device tensor is not accepted here.
        "List[int]": lambda v: isinstance(v, (list, tuple))
        and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    }.get(base)
    if ok is None:
        raise TypeError(f"{op}: emulation has no type check for {kind} ({arg.name})")
    if not ok(value):
        raise TypeError(f"{op}: argument '{arg.name}' must be {kind}, got {type(value).__name__}")


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """Map (args, kwargs) to the schema's argument names, filling defaults; TypeError on misuse."""
    schema = schemas()[op]
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}: takes {len(positional)} positional arguments, got {len(args)}")
    bound = {arg.name: value for arg, value in zip(positional, args)}
    known = {a.name for a in schema.arguments}
    for name, value in kwargs.items():
        if name not in known:
            raise TypeError(f"{op}: unexpected keyword argument '{name}'")
        if name in bound:
            raise TypeError(f"{op}: got multiple values for argument '{name}'")
        bound[name] = value
    for arg in schema.arguments:
        if arg.name not in bound:
            if not arg.has_default_value():
                raise TypeError(f"{op}: missing required argument '{arg.name}'")
            bound[arg.name] = arg.default_value
        _check_type(op, arg, bound[arg.name])
    CALLS.append((op, dict(bound)))
    return bound
