"""Closes the router's epoch at every parameter version of fully async training.
Replaces: `reset_staleness` of verl's `FullyAsyncRollouter` (experimental/fully_async_policy/
fully_async_rollouter.py:594) with a wrapper that, after verl's own bookkeeping, awaits
`end_epoch()` on the rollouter's router and adds `rollout_ext/router_*` to the dict it returns,
when the job uses rollout_ext. `FullyAsyncRollouter` is a Ray actor class (`@ray.remote`, :329):
the class its actors run is `__ray_metadata__.modified_class`, whose methods Ray has already
wrapped, so the patch replaces the method there, in the driver, before the actor is created.
Why: in fully async training the router belongs to the rollouter, an actor with no training step;
the trainer calls the rollouter's `reset_staleness()` once per parameter sync
(fully_async_trainer.py:756) and logs the dict it returns as that version's metrics, so a
parameter version is the epoch there. It runs in the rollouter's event loop, so it awaits.
Targets: verl>=0.9,<0.10 (async reset_staleness(self) -> dict). Upstream: none. Undo: revert().
Remove when verl tells its load balancer about parameter versions.
"""

from __future__ import annotations

import asyncio

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import rollout_ext_job, signature
from rollout_ext.patches.verl_epoch_end import busiest, metrics, routers


async def end_epoch_async(rollouter) -> dict | None:
    """end_epoch() of the rollouter's routers, awaited (ray.get would block the actor's loop)."""
    return busiest(list(await asyncio.gather(*(router.end_epoch.remote() for router in routers(rollouter)))))


def _make(original):
    async def reset_staleness(self, *args, **kwargs):
        timing_raw = await original(self, *args, **kwargs)
        if rollout_ext_job(self.config):
            timing_raw.update(metrics(await end_epoch_async(self)))
        return timing_raw

    return reset_staleness


_patch = Wrap("verl_epoch_end_fully_async", "verl.experimental.fully_async_policy.fully_async_rollouter",
              "FullyAsyncRollouter.__ray_metadata__.modified_class.reset_staleness", _make, signature("self"))
apply, revert = _patch.apply, _patch.revert
