"""The vLLM general plugin: `VLLM_PLUGINS=rollout_ext` (entry point group `vllm.general_plugins`).

vLLM calls `register()` in every process it starts (API server or main, engine core, each worker),
sometimes more than once per process, so it is idempotent. It builds the config, applies the patches
the config enables, and logs one line per process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from rollout_ext import __version__
from rollout_ext.config import ExtConfig

logger = logging.getLogger("vllm.rollout_ext")

_config: ExtConfig | None = None
_applied: list[str] = []


def current_config() -> ExtConfig | None:
    """The config this process registered with, or None before register()."""
    return _config


def applied_patches() -> list[str]:
    return list(_applied)


def register() -> None:
    global _config
    if _config is not None:
        return
    cfg = ExtConfig.from_env()
    _applied.extend(apply_patches(cfg))
    _config = cfg
    logger.info("%s", status_line(cfg))


def apply_patches(cfg: ExtConfig) -> list[str]:
    from rollout_ext import patches

    done = []
    for name in patches.selected(cfg):
        try:
            patches.load(name).apply(cfg)
        except patches.PatchError as e:
            if cfg.strict:
                raise
            logger.error("rollout_ext: %s; leaving vLLM unpatched for %s (ROLLOUT_EXT_STRICT=0)", e, name)
            continue
        done.append(name)
    return done


def unregister() -> None:
    """Revert every applied patch, newest first (tests and benchmarks use this)."""
    global _config
    from rollout_ext import patches

    while _applied:
        patches.load(_applied.pop()).revert()
    _config = None


def status_line(cfg: ExtConfig) -> str:
    from rollout_ext.platform import device_type, vllm_distribution

    found = vllm_distribution()
    vllm = found[1] if found else "none"
    modules = ",".join(cfg.active_modules)
    process = multiprocessing.current_process().name
    return (
        f"rollout_ext {__version__}: device={device_type()} vllm={vllm} modules=[{modules}] "
        f"(pid {os.getpid()}, {process})"
    )
