"""Control for the training tests: the sync trainer skips the weight sync between steps.

Loaded only on request, through verl's own external-module hook in every verl process:
VERL_USE_EXTERNAL_MODULES=rollout_ext.testing.skip_weight_sync (examples/dapo_train_cpu.py
--control-no-sync sets it). Importing it schedules the change; it is not part of rollout_ext's
patch registry, and no product path imports it. The replicas keep the weights of the first sync
(`on_init_end`), so from step 2 on the rollout's log-probs no longer match the actor's: verl's
`training/rollout_probs_diff_max` must then grow, which proves that check can fail.
"""

from __future__ import annotations

from rollout_ext.verl.hooks import when_imported


def _skip(module) -> None:
    trainer = module.PPOTrainerSync

    def on_step_end(self):
        print("rollout_ext control: weight sync skipped", flush=True)

    trainer.on_step_end = on_step_end


when_imported("verl.trainer.ppo.v1.trainer_sync", _skip)
