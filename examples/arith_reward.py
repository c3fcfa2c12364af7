"""verl reward functions for the arithmetic task: `compute_acc` (correctness alone, for verl's `dapo`
reward manager, which adds the overlong penalty itself) and `compute_score` (correctness plus DAPO's
overlong penalty, for managers that do not). See rollout_ext/testing/arith.py.

verl loads a reward file by path; this file re-exports the package's functions, because a module
with dataclasses cannot be loaded that way (dataclasses looks its module up in sys.modules).
"""

from rollout_ext.testing.arith import compute_acc, compute_score

__all__ = ["compute_acc", "compute_score"]
