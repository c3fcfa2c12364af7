"""Emulated `torch_npu.npu` (also reachable as `torch.npu`): the device runtime namespace.

Only what vllm-ascend's imports and layer construction touch is modelled. Any other name is a
callable that raises NotImplementedError naming itself, so a runtime call nobody emulated fails
loudly instead of returning a placeholder.
"""

import contextlib

from torch_npu._unemulated import stand_in


def is_available() -> bool:
    # There is no device: vllm-ascend code that asks must take its host path.
    return False


def device_count() -> int:
    return 0


def current_device() -> int:
    return 0


@contextlib.contextmanager
def device(_index=None):
    yield


def synchronize(_device=None) -> None:
    # Every emulated op runs synchronously on the host.
    return None


def _is_in_bad_fork() -> bool:
    # torch.manual_seed asks the PrivateUse1 module before seeding its devices.
    return False


def manual_seed_all(_seed: int) -> None:
    # No device generators: the emulated "npu" tensors live on the host, seeded by torch's CPU generator.
    return None


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return stand_in(f"torch.npu.{name}")
