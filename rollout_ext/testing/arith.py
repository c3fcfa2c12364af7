"""Step-by-step arithmetic: a verifiable task that a tiny model learns on CPU in minutes.

A prompt is a chain of additions and subtractions, e.g. "Q:71+3-5+9=". The first operand has up to
two digits, the others one digit, and the signs are chosen so that every running value stays in
0..99: each step is then a small, learnable operation.

The training target walks the chain one step at a time and ends with "A:<int>":
"71+3=74. 74-5=69. 69+9=78. A:78". Random detours make the responses of one prompt differ and
give their lengths a long tail, as in real RL rollouts: a digit-by-digit explanation of a step, a
wrong step caught with "wait," and redone, and one or more "check:" passes that restate the chain.
Long prompts get more checks, so response length follows the prompt.

compute_score is a verl reward function (correctness minus DAPO's overlong penalty); compute_acc is
correctness alone, for verl's `dapo` reward manager, which applies the penalty itself.
"""

from __future__ import annotations

import dataclasses
import random
import re

MIN_OPERANDS = 1
MAX_OPERANDS = 8
MAX_VALUE = 99  # every running value stays in 0..MAX_VALUE
MAX_STEP_OPERAND = 9  # operands after the first have one digit

# Per-step chances of a detour in the training text.
DIGITS_PROB = 0.04
WAIT_PROB = 0.04
# Chance of a first "check:" pass per step of the chain (so 8 operands: 0.21), then of each
# further pass. Repeated checks are what sampled responses stretch into rambling.
CHECK_PROB_PER_STEP = 0.03
CHECK_AGAIN_PROB = 0.25

# Defaults for the overlong penalty, in tokens (the tokenizer has one token per character).
MAX_RESPONSE_TOKENS = 512
OVERLONG_BUFFER_TOKENS = 128

ANSWER_RE = re.compile(r"A:(-?\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """operands[0] ops[0] operands[1] ops[1] ... ; len(ops) == len(operands) - 1."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def num_operands(self) -> int:
        return len(self.operands)

    @property
    def prompt(self) -> str:
        return "Q:" + _chain_text(self) + "="

    @property
    def answer(self) -> int:
        return _running_values(self)[-1]


def make_problem(rng: random.Random, num_operands: int | None = None) -> Problem:
    if num_operands is None:
        num_operands = rng.randint(MIN_OPERANDS, MAX_OPERANDS)
    if not MIN_OPERANDS <= num_operands <= MAX_OPERANDS:
        raise ValueError(f"num_operands={num_operands}; allowed: {MIN_OPERANDS}..{MAX_OPERANDS}")
    value = rng.randint(0, MAX_VALUE)
    operands, ops = [value], []
    for _ in range(num_operands - 1):
        operand = rng.randint(1, MAX_STEP_OPERAND)
        allowed = [op for op in "+-" if 0 <= _apply(value, op, operand) <= MAX_VALUE]
        op = rng.choice(allowed)
        value = _apply(value, op, operand)
        operands.append(operand)
        ops.append(op)
    return Problem(tuple(operands), tuple(ops))


def problems(seed: int, n: int, num_operands: int | None = None) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng, num_operands) for _ in range(n)]


def solution_text(problem: Problem, rng: random.Random) -> str:
    """One sampled training target for problem; always ends with "A:<answer>"."""
    values = _running_values(problem)
    steps = [(values[i], problem.ops[i], problem.operands[i + 1], values[i + 1])
             for i in range(len(problem.ops))]
    parts = []
    for a, op, b, result in steps:
        roll = rng.random()
        if roll < DIGITS_PROB:
            parts.append(_digits_text(a, op, b) + ", so " + _step_text(a, op, b, result))
        elif roll < DIGITS_PROB + WAIT_PROB:
            parts.append(_step_text(a, op, b, _wrong_result(result, rng))[:-1] + " wait, "
                         + _step_text(a, op, b, result))
        else:
            parts.append(_step_text(a, op, b, result))
    chain = " ".join(_step_text(*step) for step in steps)
    if steps and rng.random() < CHECK_PROB_PER_STEP * len(steps):
        parts.append("check: " + chain)
        while rng.random() < CHECK_AGAIN_PROB:
            parts.append("check: " + chain)
    parts.append(f"A:{problem.answer}")
    return " ".join(parts)


def extract_answer(text: str) -> int | None:
    """The last "A:<int>" in text, or None."""
    matches = ANSWER_RE.findall(text or "")
    return int(matches[-1]) if matches else None


def is_correct(text: str, answer: int) -> bool:
    return extract_answer(text) == int(answer)


def overlong_penalty(response_tokens: int, max_response_tokens: int = MAX_RESPONSE_TOKENS,
                     overlong_buffer_tokens: int = OVERLONG_BUFFER_TOKENS) -> float:
    """DAPO's soft length penalty: 0 up to max - buffer tokens, then linear down to -1 at max."""
    if not 0 < overlong_buffer_tokens <= max_response_tokens:
        raise ValueError(f"overlong_buffer_tokens={overlong_buffer_tokens}; allowed: "
                         f"1..max_response_tokens ({max_response_tokens})")
    exceed_tokens = response_tokens - (max_response_tokens - overlong_buffer_tokens)
    return min(0.0, -exceed_tokens / overlong_buffer_tokens)


def compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  max_response_tokens: int = MAX_RESPONSE_TOKENS,
                  overlong_buffer_tokens: int = OVERLONG_BUFFER_TOKENS, **_) -> dict:
    """verl reward: 1 if the last "A:<int>" equals ground_truth, else 0, plus the overlong penalty.

    The length comes from extra_info["response_length"] when the caller has it; otherwise it is
    the character count, which equals the token count for the character-level tokenizer.
    """
    acc = float(is_correct(solution_str, int(ground_truth)))
    response_tokens = (extra_info or {}).get("response_length", len(solution_str or ""))
    penalty = overlong_penalty(int(response_tokens), max_response_tokens, overlong_buffer_tokens)
    return {"score": acc + penalty, "acc": acc}


def compute_acc(data_source, solution_str, ground_truth, extra_info=None, **_) -> dict:
    """verl reward without the length penalty, for reward managers that apply DAPO's overlong
    penalty themselves (verl's `dapo` manager with overlong_buffer_cfg)."""
    acc = float(is_correct(solution_str, int(ground_truth)))
    return {"score": acc, "acc": acc}


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _running_values(problem: Problem) -> list[int]:
    values = [problem.operands[0]]
    for op, operand in zip(problem.ops, problem.operands[1:]):
        values.append(_apply(values[-1], op, operand))
    return values


def _chain_text(problem: Problem) -> str:
    text = str(problem.operands[0])
    for op, operand in zip(problem.ops, problem.operands[1:]):
        text += f"{op}{operand}"
    return text


def _step_text(a: int, op: str, b: int, result: int) -> str:
    return f"{a}{op}{b}={result}."


def _digits_text(a: int, op: str, b: int) -> str:
    """Ones digit first, then the carry or borrow into the tens: "4+9=13 carry 1, 7+1=8"."""
    tens, ones = divmod(a, 10)
    if op == "+":
        ones_sum = ones + b
        if ones_sum < 10:
            return f"{ones}+{b}={ones_sum}"
        return f"{ones}+{b}={ones_sum} carry 1, {tens}+1={tens + 1}"
    if ones >= b:
        return f"{ones}-{b}={ones - b}"
    return f"{ones + 10}-{b}={ones + 10 - b} borrow 1, {tens}-1={tens - 1}"


def _wrong_result(result: int, rng: random.Random) -> int:
    # Off by one or by ten: the slips a model makes when it misreads a digit or a carry.
    wrong = result + rng.choice((-10, -1, 1, 10))
    return wrong if wrong >= 0 else result + 1
