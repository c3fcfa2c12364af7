"""The vLLM general plugin: `VLLM_PLUGINS=rollout_ext` (entry point group `vllm.general_plugins`).

vLLM calls `register()` in every process it starts (API server or main, engine core, each worker),
sometimes more than once per process, so it is idempotent. It builds the config, binds each enabled
module to the classes this process builds (stock vLLM's or vllm-ascend's), and logs one status line
with each module's state: only what bound is listed as active.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re

import msgspec

from rollout_ext import __version__, modules
from rollout_ext.config import ExtConfig

logger = logging.getLogger("vllm.rollout_ext")

_config: ExtConfig | None = None
_applied: list[str] = []
_states: dict[str, ModuleState] = {}


class ModuleState(msgspec.Struct, frozen=True, kw_only=True):
    state: str  # one of modules.STATES
    stack: str
    patch: str | None = None
    # Why it was refused, or what made it inert or upstream.
    detail: str = ""


def current_config() -> ExtConfig | None:
    """The config this process registered with, or None before register()."""
    return _config


def applied_patches() -> list[str]:
    return list(_applied)


def module_states() -> dict[str, ModuleState]:
    """Each module's state in this process (empty before register())."""
    return dict(_states)


def register() -> None:
    global _config
    if _config is not None:
        return
    cfg = ExtConfig.from_env()
    applied, states = apply_patches(cfg)
    _applied.extend(applied)
    _states.update(states)
    _config = cfg
    logger.info("%s", status_line(_states))


def stack_label(stack: str) -> str:
    from rollout_ext.platform import vllm_ascend_version, vllm_distribution

    if stack == "vllm":
        found = vllm_distribution()
        return f"vLLM {found[1] if found else '(not installed)'}"
    return f"vllm-ascend {vllm_ascend_version()}"


def _refusal(module: modules.Module, stack: str, reason: str) -> str:
    reason = reason.rstrip(". ")
    advice = (
        "Or set ROLLOUT_EXT_STRICT=0 to run without it." if module.switch in reason
        else f"Set {module.switch}=0, or ROLLOUT_EXT_STRICT=0 to run without it."
    )
    return f"rollout_ext module {module.name!r} cannot bind on {stack_label(stack)}: {reason}. {advice}"


def apply_patches(cfg: ExtConfig, stack: str | None = None) -> tuple[list[str], dict[str, ModuleState]]:
    """Apply the infrastructure patches, then bind each enabled module on `stack` (this process's
    by default). Returns the patches applied and every module's state. Under strict mode every
    patch that cannot apply and every module that cannot bind is collected into one PatchError,
    raised after reverting what this call applied; otherwise each is logged and recorded."""
    from rollout_ext import patches
    from rollout_ext.platform import stack as current_stack

    stack = stack or current_stack()
    applied: list[str] = []
    states: dict[str, ModuleState] = {}
    failures: list[str] = []

    for name in patches.INFRASTRUCTURE:
        try:
            result = patches.load(name).apply(cfg)
        except patches.PatchError as e:
            failures.append(str(e))
            if not cfg.strict:
                logger.error("rollout_ext: %s; leaving vLLM unpatched for %s (ROLLOUT_EXT_STRICT=0)", e, name)
            continue
        if result == modules.ACTIVE:
            applied.append(name)

    for module in modules.MODULES:
        binding = module.stacks[stack]
        if not getattr(cfg, module.name):
            states[module.name] = ModuleState(state=modules.OFF, stack=stack, patch=binding.patch)
            continue
        state, detail = modules.ACTIVE, ""
        if binding.patch is None:
            state, detail = modules.REFUSED, _refusal(module, stack, binding.refusal)
        else:
            try:
                result = patches.load(binding.patch).apply(cfg)
            except patches.PatchError as e:
                state, detail = modules.REFUSED, _refusal(module, stack, str(e))
            else:
                state = result
                if state == modules.ACTIVE:
                    applied.append(binding.patch)
        if state == modules.REFUSED:
            failures.append(detail)
            if not cfg.strict:
                logger.error("%s (ROLLOUT_EXT_STRICT=0: running without it)", detail)
        states[module.name] = ModuleState(state=state, stack=stack, patch=binding.patch, detail=detail)

    if failures and cfg.strict:
        while applied:
            patches.load(applied.pop()).revert()
        if len(failures) == 1:
            raise patches.PatchError(failures[0])
        raise patches.PatchError(
            f"rollout_ext: {len(failures)} patches cannot apply (ROLLOUT_EXT_STRICT=1):\n"
            + "\n".join(f"  - {f}" for f in failures)
        )
    return applied, states


def note_engine(engine_cfg: ExtConfig) -> None:
    """Engine facts are known (the launching process builds the engine config): a module that
    does nothing at this TP size is inert, not active. Logs the status line again."""
    changed = False
    for module in modules.MODULES:
        current = _states.get(module.name)
        if current is not None and current.state == modules.ACTIVE and module.needs_tp and engine_cfg.tp_size == 1:
            _states[module.name] = msgspec.structs.replace(
                current, state=modules.INERT, detail="tensor_parallel_size=1: nothing to fuse or shard"
            )
            changed = True
    if _states and changed:
        logger.info("%s", status_line(_states))


def unregister() -> None:
    """Revert every applied patch, newest first (tests and benchmarks use this)."""
    global _config
    from rollout_ext import patches

    while _applied:
        patches.load(_applied.pop()).revert()
    _states.clear()
    _config = None


def status_line(states: dict[str, ModuleState]) -> str:
    from rollout_ext.platform import device_type, vllm_ascend_version, vllm_distribution

    found = vllm_distribution()
    vllm = found[1] if found else "none"
    ascend = vllm_ascend_version()
    by_state = {state: [name for name, s in states.items() if s.state == state] for state in modules.STATES}
    listed = " ".join(f"{state}=[{','.join(names)}]" for state, names in by_state.items() if names or state == "active")
    process = multiprocessing.current_process().name
    stack = f" vllm-ascend={ascend}" if ascend else ""
    return (
        f"rollout_ext {__version__}: device={device_type()} vllm={vllm}{stack} {listed} "
        f"(pid {os.getpid()}, {process})"
    )


_STATUS_LINE = re.compile(r"rollout_ext (?P<version>\S+): device=(?P<device>\S+) .*?active=\[(?P<active>[^\]]*)\]"
                          r"[^(]* \(pid (?P<pid>\d+), (?P<proc>[^)]+)\)")


def status_lines(log: str) -> list[dict]:
    """Every `status_line` in a log: version, device, active (module names), pid and process name."""
    return [{**m.groupdict(), "active": [n for n in m["active"].split(",") if n]} for m in _STATUS_LINE.finditer(log)]
