"""One log line when each phase of a verl training step starts and ends, with its seconds.
Replaces: `verl.utils.debug.marked_timer` (the context manager verl's trainers time their phases
with, trainer/ppo/v1/trainer_base.py:565-609, trainer_sync.py:36) with a wrapper that logs
`rollout_ext phase: <name> start` and `rollout_ext phase: <name> end <seconds> s` for the step's
phases (PHASES) and passes everything else through unchanged.
Why: a training step on a real cluster runs for minutes with no output until its metrics line, so
a hang or a dead replica cannot be told apart from slow work; with a line per phase, a user (and
examples/dapo_train_cpu.py's fail-fast watch) knows which phase was running when the job stopped.
The trainer modules import the name with `from verl.utils.debug import marked_timer`, so this is
applied right after verl.utils.debug is imported, before any trainer module binds it.
Targets: verl>=0.9,<0.10 (marked_timer(name, timing_raw, color, domain, category)). Upstream: none.
Undo: revert() (modules that bound the wrapper keep it; it only logs). Remove when verl logs phases.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

from rollout_ext.patches._base import Wrap
from rollout_ext.patches._verl import signature

PHASES = frozenset({"step", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
                    "update_actor", "update_weights", "testing", "save_checkpoint"})

logger = logging.getLogger("rollout_ext.phase")
if not logger.handlers:
    # verl sets the root logger to WARNING in its processes; phase lines are INFO and must show.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _make(original):
    @contextmanager
    def marked_timer(name, timing_raw, *args, **kwargs):
        if name not in PHASES:
            with original(name, timing_raw, *args, **kwargs):
                yield
            return
        logger.info("rollout_ext phase: %s start", name)
        started = time.perf_counter()
        with original(name, timing_raw, *args, **kwargs):
            yield
        logger.info("rollout_ext phase: %s end %.2f s", name, time.perf_counter() - started)

    return marked_timer


_patch = Wrap("verl_phase_log", "verl.utils.debug", "marked_timer", _make, signature("name", "timing_raw"))
apply, revert = _patch.apply, _patch.revert
