"""Version and signature guards shared by the parity patches, plus the name swap they all use."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rollout_ext.platform import dist_version
from rollout_ext.verl.names import BACKEND, VLLM_BACKEND

# Every site was read in verl 0.9.1; 0.9.x patch releases keep these signatures.
SUPPORTED_VERL = SpecifierSet(">=0.9,<0.10")


class ParityPatchError(RuntimeError):
    """verl changed under a parity patch: the patch would no longer do what its header says."""


def check_target(patch: str, func, expected_params: tuple[str, ...]) -> None:
    """Fail, naming the patch and the verl version, when verl moved or `func` changed shape."""
    found = dist_version("verl")
    if found is None or Version(Version(found).base_version) not in SUPPORTED_VERL:
        raise ParityPatchError(f"rollout_ext.verl.parity.{patch}: written for verl {SUPPORTED_VERL}, found {found}")
    params = tuple(inspect.signature(func).parameters)
    if params[: len(expected_params)] != expected_params:
        raise ParityPatchError(
            f"rollout_ext.verl.parity.{patch}: {func.__qualname__}{params} no longer starts with "
            f"{expected_params} in verl {found}; re-read the site before re-enabling this patch"
        )


def backend_name(rollout_config) -> str | None:
    """The rollout's name, or None when unset: an unset ('???') DictConfig name is left for verl
    to report in its own words, not raised here as omegaconf's MissingMandatoryValue."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(rollout_config, DictConfig) and OmegaConf.is_missing(rollout_config, "name"):
        return None
    return getattr(rollout_config, "name", None)


@contextmanager
def named_as_vllm(rollout_config) -> Iterator[None]:
    """While inside, a rollout_ext RolloutConfig (dataclass) or rollout DictConfig says name='vllm'."""
    if backend_name(rollout_config) != BACKEND:
        yield
        return
    set_name(rollout_config, VLLM_BACKEND)
    try:
        yield
    finally:
        set_name(rollout_config, BACKEND)


def set_name(rollout_config, name: str) -> None:
    from omegaconf import DictConfig, open_dict, read_write

    if isinstance(rollout_config, DictConfig):
        with read_write(rollout_config), open_dict(rollout_config):
            rollout_config.name = name
    else:
        # verl's config dataclasses are frozen after __post_init__.
        object.__setattr__(rollout_config, "name", name)
