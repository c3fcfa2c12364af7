"""Starts verl's training process group with the one backend a CPU job has: `cpu:gloo`.
Replaces: `verl.utils.distributed.initialize_global_process_group_ray`, called without a backend
(verl/workers/engine_workers.py:89), with the same call and backend="cpu:gloo".
Why: the default backend is f"cpu:gloo,{device}:{ccl}" (verl/utils/distributed.py:87). On the CPU
platform (rollout_ext/verl/cpu_platform.py) that reads "cpu:gloo,cpu:gloo", which torch rejects
("Duplicate device type cpu"). Applies only with VERL_PLATFORM=cpu; apply() does nothing otherwise.
Targets: verl>=0.9,<0.10 (initialize_global_process_group_ray(timeout_second, backend)).
Upstream: none. Undo: revert(). Remove when verl builds the backend string without duplicates.
"""

from __future__ import annotations

from rollout_ext.modules import INERT
from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import signature
from rollout_ext.verl import cpu_platform

BACKEND = "cpu:gloo"


def _make(original):
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or BACKEND)

    return initialize_global_process_group_ray


_patch = Wrap("verl_cpu_process_group", "verl.utils.distributed", "initialize_global_process_group_ray", _make,
              signature("timeout_second", "backend"))
revert = _patch.revert


def apply(cfg=None) -> str:
    return _patch.apply() if cpu_platform.selected() else INERT
