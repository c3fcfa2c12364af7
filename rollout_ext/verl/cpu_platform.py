"""A CPU platform for verl, so that `verl.trainer.main_ppo` trains on a machine without accelerators.

verl 0.9.1 registers nvidia, huawei and amd only (verl/plugin/platform/platform_manager.py:172-174)
and falls back to nvidia when none is found (:113-117), so on CPU every device call asks for CUDA.
This platform answers for the CPU: device `cpu`, gloo collectives, no IPC (weights travel through
/dev/shm, verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py:182-195), and `GPU` as the
Ray resource, so a CPU cluster declares logical GPUs (`ray.init(num_gpus=N)`) for verl's bundles.

It is registered by the `verl.plugins` entry point in every verl process, and only when
VERL_PLATFORM=cpu is set: auto-detection never picks it. The two places where verl 0.9.1 still
assumes an accelerator beyond the platform object are patches (rollout_ext.patches): the process
group backend (verl_cpu_process_group) and the FSDP engine registry (verl_cpu_engines).
Targets: verl>=0.9,<0.10 (PlatformBase's abstract methods are checked on registration).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType

import torch

NAME = "cpu"


def _device_module() -> ModuleType:
    """torch.cpu plus what verl calls on `get_torch_device()` that torch.cpu lacks: the cache,
    memory-stat and RNG calls of torch.cuda. The CPU allocator keeps no statistics, so the memory
    calls report 0 (and mem_get_info the host's free and total RAM)."""
    module = ModuleType("rollout_ext.verl.cpu_device")
    for name in ("synchronize", "current_stream", "stream", "Stream", "Event", "device_count", "is_available",
                 "set_device", "current_device"):
        setattr(module, name, getattr(torch.cpu, name))

    def zero(*_args, **_kwargs) -> int:
        return 0

    def nothing(*_args, **_kwargs) -> None:
        return None

    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, zero)
    for name in ("empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_per_process_memory_fraction"):
        setattr(module, name, nothing)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda *_args: torch.get_rng_state()
    module.set_rng_state = lambda state, *_args: torch.set_rng_state(state)
    module.get_device_name = lambda *_args: "cpu"
    module.mem_get_info = _mem_get_info
    return module


def _mem_get_info(*_args) -> tuple[int, int]:
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def platform_class():
    """The PlatformBase subclass (built on first use, so importing this module imports no verl)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl on CPU: gloo, no IPC, logical GPUs for Ray's bundles."""

        _module = _device_module()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return self._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return False  # only VERL_PLATFORM=cpu selects it

        def current_device(self) -> str:
            # verl passes this to `.to(...)` and `device=` (fsdp/transformer_impl.py:730,1552).
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets it for actors that hold logical GPUs; verl reads it to name local ranks.
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


def selected() -> bool:
    """VERL_PLATFORM=cpu, read through the one config reader."""
    from rollout_ext.config import environ_copy

    return environ_copy().get("VERL_PLATFORM", "").strip().lower() == NAME


def register() -> bool:
    """Register the platform with verl when VERL_PLATFORM=cpu; idempotent. True when registered."""
    if not selected():
        return False
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from rollout_ext.patches._verl import require_verl

    require_verl("cpu_platform")

    if PlatformRegistry.get(NAME) is None:
        PlatformRegistry.register(platform=NAME)(platform_class())
    return True
