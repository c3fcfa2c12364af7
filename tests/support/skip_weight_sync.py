"""Control for the training tests: the sync trainer stops syncing weights after step 1.

Loaded only on request, through verl's own external-module hook in every verl process:
VERL_USE_EXTERNAL_MODULES=skip_weight_sync with tests/support on PYTHONPATH (examples/dapo_train_cpu.py
--control-no-sync sets both). Importing it schedules the change; it lives under tests/, outside the
package, and no product path imports it. The sync after step 1 still runs, so step 2's
rollout proves the sync works (verl's `training/rollout_probs_diff_max` ~1e-6). Every later sync
is skipped: from step 3 on, the replicas keep step 1's weights while the actor has moved on, so
that same check must then grow, which proves it can fail. One job shows both sides.
"""

from __future__ import annotations

from rollout_ext.verl.hooks import when_imported

LAST_SYNCED_STEP = 1


def _skip(module) -> None:
    trainer = module.PPOTrainerSync
    sync = trainer.on_step_end

    def on_step_end(self):
        # verl calls this at the end of step `self.global_steps` (1-based), before incrementing it.
        if self.global_steps <= LAST_SYNCED_STEP:
            return sync(self)
        print(f"rollout_ext control: weight sync skipped after step {self.global_steps}", flush=True)

    trainer.on_step_end = on_step_end


when_imported("verl.trainer.ppo.v1.trainer_sync", _skip)
