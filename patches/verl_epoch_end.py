"""Closes the router's epoch after every training step, so the length predictor learns from history.
Replaces: `verl.trainer.ppo.v1.trainer_base.PPOTrainer.step` (the v1 trainers: sync, colocate_async,
separate_async) with a wrapper that, once the step (its rollout, then the update) has run, calls
`end_epoch()` on the router that routes this trainer's rollout, when the job uses rollout_ext and
that router has one (TailAwareRouter does). Its numbers go into the step's metrics as
`rollout_ext/router_*`. One-step-off and fully async have their own step sites
(patches/verl_epoch_end_separate.py, patches/verl_epoch_end_fully_async.py).
Why: the tail-aware policy predicts a prompt's lengths from its earlier epochs, and turns a batch
into history only in `end_epoch()`; nothing in verl calls it, so without this a real job never
builds cross-epoch history. separate_async routes through `standalone_server_manager`'s router,
not `llm_server_manager`'s (trainer_separate_async.py:213-215), so every manager that
`_rollout_server_managers()` lists is asked, and the router that placed the most chunks reports.
Targets: verl>=0.9,<0.10 (PPOTrainer.step(self, metrics, timing_raw); routers at
`<manager>.global_load_balancer`). Upstream: none. Undo: revert().
Remove when verl tells its load balancer about step boundaries.
"""

from __future__ import annotations

import logging

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import rollout_ext_job, signature

logger = logging.getLogger("rollout_ext")


def routers(trainer) -> list:
    """The routers of a trainer's (or rollouter's) rollout that have end_epoch, each once."""
    if hasattr(trainer, "_rollout_server_managers"):
        managers = trainer._rollout_server_managers()
    else:
        managers = [getattr(trainer, "llm_server_manager", None)]
    found = []
    for manager in managers:
        router = getattr(manager, "global_load_balancer", None)
        try:
            router.end_epoch  # noqa: B018 -- a Ray handle raises AttributeError for a method it lacks
        except AttributeError:
            continue
        if all(router is not seen for seen in found):
            found.append(router)
    return found


def end_epoch(trainer) -> dict | None:
    """Close the epoch of every router that has one; the summary of the busiest, or None."""
    import ray

    summaries = ray.get([router.end_epoch.remote() for router in routers(trainer)])
    return busiest(summaries)


def metrics(summary: dict | None) -> dict:
    """A router summary as step metrics, under verl's naming."""
    if summary is None:
        return {}
    logger.info("rollout_ext: router epoch closed: %s", summary)
    return {f"rollout_ext/router_{k}": v for k, v in summary.items() if isinstance(v, int | float)}


def busiest(summaries: list[dict]) -> dict | None:
    return max(summaries, key=lambda s: s.get("acquires", 0), default=None)


def _make(original):
    def step(self, metrics_out, timing_raw):
        batch = original(self, metrics_out, timing_raw)
        if rollout_ext_job(self.config):
            metrics_out.update(metrics(end_epoch(self)))
        return batch

    return step


_patch = Wrap("verl_epoch_end", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer.step", _make,
              signature("self", "metrics", "timing_raw"))
apply, revert = _patch.apply, _patch.revert
