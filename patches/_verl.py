"""What the verl-side patches share: the verl version and signature guards, and the rollout-name swap."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from rollout_ext.patches._base import PatchError
from rollout_ext.platform import dist_version
from rollout_ext.verl.names import BACKEND, VLLM_BACKEND

# Every site was read in verl 0.9.1; 0.9.x patch releases keep these signatures.
SUPPORTED_VERL = SpecifierSet(">=0.9,<0.10")


class VerlPatchError(PatchError):
    """verl changed under a verl-side patch: the patch would no longer do what its header says."""


def require_verl(patch: str) -> str:
    """The installed verl version; fails, naming the patch, outside SUPPORTED_VERL."""
    found = dist_version("verl")
    if found is None or Version(Version(found).base_version) not in SUPPORTED_VERL:
        raise VerlPatchError(f"rollout_ext patch {patch!r}: written for verl {SUPPORTED_VERL}, found {found}")
    return found


def check_target(patch: str, func, expected_params: tuple[str, ...]) -> None:
    """Fail, naming the patch and the verl version, when verl moved or `func` changed shape."""
    found = require_verl(patch)
    params = tuple(inspect.signature(func).parameters)
    if params[: len(expected_params)] != expected_params:
        raise VerlPatchError(
            f"rollout_ext patch {patch!r}: {func.__qualname__}{params} no longer starts with "
            f"{expected_params} in verl {found}; re-read the site before re-enabling this patch"
        )


def signature(*expected_params: str):
    """A Wrap guard: verl's version, and `expected_params` leading the wrapped function's signature."""

    def guard(patch: str, func) -> None:
        check_target(patch, func, expected_params)

    return guard


def rollout_ext_job(config) -> bool:
    """True when a trainer config selects rollout.name=rollout_ext."""
    try:
        rollout = config.actor_rollout_ref.rollout
    except AttributeError:
        return False
    return backend_name(rollout) == BACKEND


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
