"""ExtConfig: the one frozen config of rollout_ext, and the only reader of os.environ.

Built once per process from the environment (`ExtConfig.from_env()`), so every process of a vLLM
engine (API server, engine core, workers) and every verl replica sees the same switches as long as
the environment travels with it. Engine facts that only vLLM knows (TP size, chunked prefill, graph
mode) are merged later with `with_engine(...)`, and `check()` is run again before the engine starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

import msgspec

from rollout_ext import modules

logger = logging.getLogger("rollout_ext")

PREFIX = "ROLLOUT_EXT_"

# Old vllm-ascend switches still found in users' launch scripts: alias -> our field.
ALIASES = modules.aliases()

HCCL_EXPANSION_MODES = ("AI_CPU", "AIV", "HOST", "HOST_TS")
MODULES = modules.NAMES


class ConfigError(ValueError):
    """A bad value in the environment, or features that cannot run together."""


class _Config(msgspec.Struct, frozen=True, kw_only=True):
    """ExtConfig without the module fields, which come from the module table (see ExtConfig)."""

    # Fail when a patch cannot be applied; with 0, log it and leave vLLM unpatched.
    strict: bool = True
    # This replica's weights are synced from a trainer (rollout_ext's verl replica sets it for
    # hybrid and colocated rollouts); on CPU, linear layers then keep a reloadable weight.
    weight_sync: bool = False
    # CANN TASK_QUEUE_ENABLE (0, 1 or 2); None when unset.
    task_queue_enable: int | None = None
    # CANN HCCL_OP_EXPANSION_MODE; None when unset.
    hccl_op_expansion_mode: str | None = None
    # NPU graph mode (= not enforce_eager); None until the engine tells us.
    graph_mode: bool | None = None
    # vLLM chunked prefill; None until the engine tells us.
    chunked_prefill: bool | None = None
    # vLLM tensor_parallel_size; None until the engine tells us.
    tp_size: int | None = None
    # CANN toolkit root, for version reporting only.
    ascend_toolkit_home: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExtConfig:
        """Parse the environment; raise one ConfigError listing every bad value or conflict."""
        env = os.environ if env is None else env
        values, errors = _parse(env)
        if errors:
            raise ConfigError("rollout_ext: bad environment:\n" + "\n".join(f"  - {e}" for e in errors))
        cfg = cls(**values)
        cfg.raise_on_conflicts()
        return cfg

    def with_engine(self, *, tp_size: int, chunked_prefill: bool, enforce_eager: bool) -> ExtConfig:
        """Merge what vLLM's engine config says; an explicit ROLLOUT_EXT_GRAPH_MODE wins."""
        graph_mode = (not enforce_eager) if self.graph_mode is None else self.graph_mode
        return msgspec.structs.replace(self, tp_size=tp_size, chunked_prefill=chunked_prefill, graph_mode=graph_mode)

    @property
    def enabled_modules(self) -> list[str]:
        return [name for name in MODULES if getattr(self, name)]

    def conflicts(self) -> list[str]:
        """Each entry: what clashes, and how to resolve it."""
        found = [
            f"{modules.get(a).switch}=1 with {modules.get(b).switch}=1: {why}"
            for a, b, why in modules.conflict_pairs()
            if getattr(self, a) and getattr(self, b)
        ]
        if self.fav2 and self.chunked_prefill:
            found.append(
                "ROLLOUT_EXT_FAV2=1 with chunked prefill on: the FAV2 prefill kernel takes whole "
                "prompts. Set enable_chunked_prefill=False, or drop ROLLOUT_EXT_FAV2 (chunked prefill "
                "measured faster on long sequences)."
            )
        if self.task_queue_enable == 2 and self.graph_mode:
            found.append(
                "TASK_QUEUE_ENABLE=2 with graph mode: level-2 task queue is for eager execution. "
                "Set TASK_QUEUE_ENABLE=1, or run with enforce_eager=True."
            )
        if self.hccl_op_expansion_mode == "AIV" and self.mc2:
            found.append(
                "HCCL_OP_EXPANSION_MODE=AIV with ROLLOUT_EXT_MC2=1: mc2 drives HCCL itself. "
                "Unset HCCL_OP_EXPANSION_MODE, or set ROLLOUT_EXT_MC2=0."
            )
        return found

    def warnings(self) -> list[str]:
        found = []
        if self.tp_size == 1:
            for module in modules.MODULES:
                if module.needs_tp and getattr(self, module.name):
                    found.append(f"{module.switch}=1 does nothing with tensor_parallel_size=1.")
        if self.chunked_prefill is False and not self.fav2:
            found.append(
                "chunked prefill is off, but no rollout_ext module needs it off; V1 with chunked "
                "prefill measured ~15% faster for rollout. Set enable_chunked_prefill=True."
            )
        return found

    def raise_on_conflicts(self) -> None:
        found = self.conflicts()
        if found:
            raise ConfigError(
                f"rollout_ext: {len(found)} feature conflict(s):\n" + "\n".join(f"  - {c}" for c in found)
            )

    def to_env(self) -> dict[str, str]:
        """The canonical variables that rebuild this config in another process."""
        env = {
            f"{PREFIX}{name.upper()}": _format(getattr(self, name))
            for name, _ in _SWITCHES
            if getattr(self, name) is not None
        }
        if self.task_queue_enable is not None:
            env["TASK_QUEUE_ENABLE"] = str(self.task_queue_enable)
        if self.hccl_op_expansion_mode is not None:
            env["HCCL_OP_EXPANSION_MODE"] = self.hccl_op_expansion_mode
        return env


# The module switches and their settings are fields of the one config, built from the module table:
# `rope_cache: bool = True`, `mc2: bool = False`, `mc2_min_tokens: int = 256`, ... (rollout_ext.modules).
ExtConfig = msgspec.defstruct(
    "ExtConfig",
    [
        *((module.name, bool, module.default) for module in modules.MODULES),
        *((setting.name, int, setting.default) for setting in modules.settings()),
    ],
    bases=(_Config,),
    module=__name__,
    frozen=True,
    kw_only=True,
)


def _format(value) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ConfigError(f"{name}={raw!r} is not allowed; use 0 or 1 (true/false also accepted)")


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={raw!r} is not allowed; use an integer >= 1")
    return value


def _task_queue(name: str, raw: str) -> int:
    if raw.strip() not in ("0", "1", "2"):
        raise ConfigError(f"{name}={raw!r} is not allowed; use 0, 1 or 2")
    return int(raw)


def _expansion_mode(name: str, raw: str) -> str:
    if raw.strip() not in HCCL_EXPANSION_MODES:
        raise ConfigError(f"{name}={raw!r} is not allowed; use one of {', '.join(HCCL_EXPANSION_MODES)}")
    return raw.strip()


# (field, parser) for every ROLLOUT_EXT_<FIELD> variable.
# The module switches and settings come from the module table.
_SWITCHES: list[tuple[str, Callable[[str, str], object]]] = [
    *((name, _bool) for name in modules.NAMES),
    *((setting.name, _positive_int) for setting in modules.settings()),
    ("strict", _bool),
    ("weight_sync", _bool),
    ("graph_mode", _bool),
]

# Variables we own or watch; anything else starting with PREFIX is a typo worth reporting.
_KNOWN = {f"{PREFIX}{name.upper()}" for name, _ in _SWITCHES}


def _parse(env: Mapping[str, str]) -> tuple[dict, list[str]]:
    values: dict = {}
    errors: list[str] = []

    def parse(name: str, parser, raw: str):
        try:
            return parser(name, raw)
        except ConfigError as e:
            errors.append(str(e))
            return None

    for field, parser in _SWITCHES:
        var = f"{PREFIX}{field.upper()}"
        if var in env and env[var] != "":
            value = parse(var, parser, env[var])
            if value is not None:
                values[field] = value

    for alias, field in ALIASES.items():
        if alias not in env or env[alias] == "":
            continue
        value = parse(alias, _bool, env[alias])
        if value is None:
            continue
        canonical = f"{PREFIX}{field.upper()}"
        if field in values and values[field] != value:
            errors.append(f"{alias}={env[alias]!r} contradicts {canonical}={env[canonical]!r}; unset {alias}")
            continue
        logger.warning("rollout_ext: %s is deprecated; use %s instead", alias, canonical)
        values.setdefault(field, value)

    for var in sorted(env):
        if var.startswith(PREFIX) and var not in _KNOWN:
            allowed = ", ".join(sorted(_KNOWN))
            errors.append(f"{var} is not a rollout_ext variable; known: {allowed}")

    if env.get("TASK_QUEUE_ENABLE", "") != "":
        values["task_queue_enable"] = parse("TASK_QUEUE_ENABLE", _task_queue, env["TASK_QUEUE_ENABLE"])
    if env.get("HCCL_OP_EXPANSION_MODE", "") != "":
        values["hccl_op_expansion_mode"] = parse(
            "HCCL_OP_EXPANSION_MODE", _expansion_mode, env["HCCL_OP_EXPANSION_MODE"]
        )
    home = env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH")
    if home:
        values["ascend_toolkit_home"] = home
    return values, errors


def environ_copy() -> dict[str, str]:
    """A copy of this process's environment, for tools that start child processes with changes."""
    return dict(os.environ)
