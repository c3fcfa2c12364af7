"""Ray runtime_env presets: the environment a rollout replica needs to load rollout_ext.

`python -m rollout_ext env --preset NAME` prints one as YAML for `ray job submit --runtime-env`.
Every preset is validated by building an ExtConfig from it, so a preset can never hold a conflict.
"""

from __future__ import annotations

import re

from packaging.version import Version

from rollout_ext import __version__
from rollout_ext.config import ExtConfig

# vLLM stopped reading VLLM_USE_V1 when V0 was removed (0.11); older releases need it set.
LAST_VLLM_READING_USE_V1 = Version("0.10.99")

_A2_COMMON = {
    "VLLM_PLUGINS": "rollout_ext",
    # Level-2 task queue: best for eager rollout on A2 in field reports; it is for eager mode only.
    "TASK_QUEUE_ENABLE": "2",
    "ROLLOUT_EXT_GRAPH_MODE": "0",
    "ROLLOUT_EXT_ROPE_CACHE": "1",
    "ROLLOUT_EXT_FLASHCOMM": "0",
    "ROLLOUT_EXT_MLP_ONLY_TP": "0",
    "ROLLOUT_EXT_FAV2": "0",
}

PRESETS: dict[str, tuple[str, dict[str, str]]] = {
    "dapo-a2-tp4": (
        "DAPO rollout on Atlas A2, TP4: rope hoist, HCCL AIV expansion (mc2 off), eager + task queue 2",
        {**_A2_COMMON, "ROLLOUT_EXT_MC2": "0", "HCCL_OP_EXPANSION_MODE": "AIV"},
    ),
    "dapo-a2-tp8": (
        "DAPO rollout on Atlas A2, TP8: rope hoist, mc2 fused matmul+all-reduce (+5% in A2 field reports), eager + task queue 2",
        {**_A2_COMMON, "ROLLOUT_EXT_MC2": "1"},
    ),
    "cpu-dev": (
        "CPU development: the plugin with the exact device-neutral modules",
        {
            "VLLM_PLUGINS": "rollout_ext",
            "ROLLOUT_EXT_ROPE_CACHE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
        },
    ),
}


def preset_env(name: str, vllm_version: Version | None = None, overrides: dict[str, str] | None = None) -> dict:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not known; choose one of: {', '.join(PRESETS)}")
    env = dict(PRESETS[name][1])
    if vllm_version is not None and vllm_version <= LAST_VLLM_READING_USE_V1:
        env["VLLM_USE_V1"] = "1"
    env.update(overrides or {})
    ExtConfig.from_env(env)
    return env


_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.,/-]*$")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(value: str) -> str:
    if _BARE.match(value) and value.lower() not in _YAML_WORDS:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_yaml(name: str, env: dict[str, str]) -> str:
    lines = [
        f"# rollout_ext {__version__} preset {name}: {PRESETS[name][0]}",
        "# Use: ray job submit --runtime-env THIS_FILE -- python -m verl.trainer.main_ppo ...",
        "env_vars:",
    ]
    lines += [f"  {key}: {_scalar(value)}" for key, value in env.items()]
    return "\n".join(lines) + "\n"
