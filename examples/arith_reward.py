"""Rule-based reward for the arithmetic prompts of the tiny CPU example (verl's compute_score signature).

Score 1.0 when the last integer in the response equals the ground truth, else 0.0; `acc` is what
DAPO's dynamic-sampling filter (algorithm.filter_groups.metric=acc) groups on.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_):
    numbers = _INTEGER.findall(solution_str or "")
    correct = bool(numbers) and numbers[-1] == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": float(correct)}
