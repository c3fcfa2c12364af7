"""Closes the router's epoch after every step of the trainers built on SeparateRayPPOTrainer.
Replaces: `verl.experimental.separation.ray_trainer.SeparateRayPPOTrainer._fit_collect_metrics`
with a wrapper that, after verl collected the step's metrics, calls `end_epoch()` on the trainer's
router (patches/verl_epoch_end.py: `end_epoch`) and adds `rollout_ext/router_*` to the same
metrics, when the job uses rollout_ext.
Why: one-step-off (`OneStepOffRayTrainer`, experimental/one_step_off_policy/ray_trainer.py:379)
is not a v1 PPOTrainer, so the v1 step patch never runs there and the length predictor would
build no history. `_fit_collect_metrics` runs once per step after the update, with the step's
metrics at `self.metrics`. The fully async trainer also runs it, but holds no router (its
rollouter, a separate actor, does), so there it does nothing.
Targets: verl>=0.9,<0.10 (_fit_collect_metrics(self, batch)). Upstream: none. Undo: revert().
Remove when verl tells its load balancer about step boundaries.
"""

from __future__ import annotations

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import rollout_ext_job, signature
from rollout_ext.patches.verl_epoch_end import end_epoch, metrics


def _make(original):
    def _fit_collect_metrics(self, batch):
        original(self, batch)
        if rollout_ext_job(self.config):
            self.metrics.update(metrics(end_epoch(self)))

    return _fit_collect_metrics


_patch = Wrap("verl_epoch_end_separate", "verl.experimental.separation.ray_trainer",
              "SeparateRayPPOTrainer._fit_collect_metrics", _make, signature("self", "batch"))
apply, revert = _patch.apply, _patch.revert
