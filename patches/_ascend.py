"""What the vllm-ascend bindings share: finding a hook in vllm-ascend, and naming its version
when it is not where the binding expects it."""

from __future__ import annotations

import ast
import importlib

from rollout_ext.patches._base import PatchError, require_signature


def ascend_label() -> str:
    from rollout_ext.platform import vllm_ascend_version

    return f"vllm-ascend {vllm_ascend_version() or '(not importable)'}"


def require_hook(patch: str, module_name: str, qualname: str):
    """`module_name`'s attribute path `qualname` (e.g. "AscendRowParallelLinear.forward"); PatchError
    naming the patch, the vllm-ascend version and the missing hook when it is not there."""
    try:
        owner = importlib.import_module(module_name)
    except Exception as e:  # vllm-ascend's modules import torch_npu and much else
        raise PatchError(f"rollout_ext patch {patch!r}: importing {module_name} failed on {ascend_label()}: {e!r}") from e
    for part in qualname.split("."):
        # The class's own attribute, or an inherited one: a hook is what the class resolves.
        found = getattr(owner, part, None)
        if found is None:
            raise PatchError(
                f"rollout_ext patch {patch!r}: {ascend_label()} has no {module_name}.{qualname} "
                f"(missing hook); the upstream code moved and this binding needs updating"
            )
        owner = found
    return owner


def require_params(patch: str, func, params: list[str]) -> None:
    """_base.require_signature, naming the vllm-ascend version."""
    require_signature(patch, func, params, upstream=ascend_label())


def require_own(patch: str, cls: type, attr: str) -> None:
    """The hook must be defined on `cls` itself: a swap on an inherited method would change the
    base class's behaviour for every other subclass."""
    if attr not in cls.__dict__:
        raise PatchError(
            f"rollout_ext patch {patch!r}: {ascend_label()}: {cls.__qualname__} no longer defines {attr} "
            f"itself (missing hook); this binding needs updating"
        )


def _calls(func) -> list:
    """Every call expression in `func`'s source (comments and strings are not calls)."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _is_call_to(call: ast.Call, callee: str) -> bool:
    """`call` calls `callee`, by that name or as an attribute of that name."""
    target = call.func
    return (isinstance(target, ast.Name) and target.id == callee) or (
        isinstance(target, ast.Attribute) and target.attr == callee)


def calls_named(func, callee: str) -> bool:
    """Does `func` call `callee` (by that name, or as an attribute of that name)?"""
    return any(_is_call_to(c, callee) for c in _calls(func))


def calls_super(func, method: str) -> bool:
    """Does `func` call `super().<method>(...)`?"""
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == method and isinstance(c.func.value, ast.Call)
               and isinstance(c.func.value.func, ast.Name) and c.func.value.func.id == "super"
               for c in _calls(func))


def keyword_passed(func, callee: str, keyword: str) -> bool:
    """Does `func` call `callee` (as a name or an attribute) with `keyword=...`?"""
    return any(_is_call_to(c, callee) and any(k.arg == keyword for k in c.keywords) for c in _calls(func))


def require_call(patch: str, func, callee: str, why: str) -> None:
    """`func` must call `callee` (by that name, or as an attribute of that name)."""
    if calls_named(func, callee):
        return
    raise PatchError(f"rollout_ext patch {patch!r}: {ascend_label()}: {func.__qualname__} no longer calls "
                     f"{callee} ({why}) (missing hook); this binding needs updating")


# vllm-ascend's linear classes that a dense model builds; flashcomm and mlp_only_tp wrap vLLM's
# forward, which these reach through `super().forward(input_)` when they have no custom op.
ASCEND_LINEARS = ("AscendRowParallelLinear", "AscendMergedColumnParallelLinear", "AscendQKVParallelLinear")


def require_vllm_linear_forward(patch: str) -> None:
    """For a module that wraps vLLM's linear forward: on vllm-ascend, each of ASCEND_LINEARS must
    still run it (its own forward falls back to it, or it has none of its own). Nothing to check
    on stock vLLM."""
    from rollout_ext.platform import stack

    if stack() == "vllm":
        return
    for name in ASCEND_LINEARS:
        cls = require_hook(patch, "vllm_ascend.ops.linear", name)
        if "forward" not in cls.__dict__:
            continue
        if not calls_super(cls.__dict__["forward"], "forward"):
            raise PatchError(f"rollout_ext patch {patch!r}: {ascend_label()}: {name}.forward no longer falls back "
                             f"to super().forward (vLLM's, which this module wraps) (missing hook); this "
                             f"binding needs updating")


def require_super_call(patch: str, cls: type, method: str, why: str) -> None:
    """`cls.method`, where `cls` defines it, must reach its base's through super().method; a class
    that does not define it inherits the base's, which is fine too."""
    own = cls.__dict__.get(method)
    if own is not None and not calls_super(own, method):
        raise PatchError(f"rollout_ext patch {patch!r}: {ascend_label()}: {cls.__qualname__}.{method} no longer "
                         f"calls super().{method} ({why}) (missing hook); this binding needs updating")
