"""A learnable toy reward for the tiny CPU training example (verl's compute_score signature).

Score: the share of the response's letters that are vowels (a, e, i, o, u), in [0, 1]. A random
tiny model gets about 0.3, and the samples of one prompt differ, so DAPO's group filter
(metric `acc`, here the score itself) keeps the group and GRPO's advantages are not all zero; the
policy can raise the score by putting mass on vowel-rich tokens.
"""

from __future__ import annotations

VOWELS = frozenset("aeiou")


def compute_score(data_source, solution_str, ground_truth=None, extra_info=None, **_):
    letters = [c for c in (solution_str or "").lower() if c.isascii() and c.isalpha()]
    score = sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0
    return {"score": score, "acc": score}
