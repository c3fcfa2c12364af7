"""Closes the router's epoch after every training step, so the length predictor learns from history.
Replaces: `verl.trainer.ppo.v1.trainer_base.PPOTrainer.step` with a wrapper that, once the step
(its rollout, then the update) has run, calls the router's `end_epoch()` when the job uses
rollout_ext and its router has one (TailAwareRouter does). Its numbers go into the step's metrics
as `rollout_ext/router_*`.
Why: the tail-aware policy predicts a prompt's lengths from its earlier epochs, and turns a batch
into history only in `end_epoch()`; nothing in verl calls it, so without this a real job never
builds cross-epoch history. The router's answer (epochs closed, moves so far) is logged.
Targets: verl>=0.9,<0.10 (PPOTrainer.step(self, metrics, timing_raw); the router handle is
`self.llm_server_manager.global_load_balancer`). Upstream: none. Undo: revert().
Remove when verl tells its load balancer about step boundaries.
"""

from __future__ import annotations

import logging

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import rollout_ext_job, signature

logger = logging.getLogger("rollout_ext")


def end_epoch(trainer) -> dict | None:
    """The router's end_epoch() result, or None when this job's router has none."""
    import ray

    manager = getattr(trainer, "llm_server_manager", None)
    router = getattr(manager, "global_load_balancer", None)
    try:
        method = router.end_epoch
    except AttributeError:
        return None
    return ray.get(method.remote())


def _make(original):
    def step(self, metrics, timing_raw):
        batch = original(self, metrics, timing_raw)
        if rollout_ext_job(self.config):
            summary = end_epoch(self)
            if summary is not None:
                metrics.update({f"rollout_ext/router_{k}": v for k, v in summary.items() if isinstance(v, int | float)})
                logger.info("rollout_ext: router epoch closed: %s", summary)
        return batch

    return step


_patch = Wrap("verl_epoch_end", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer.step", _make,
              signature("self", "metrics", "timing_raw"))
apply, revert = _patch.apply, _patch.revert
