"""The arithmetic task, its reward, its tokenizer and the model builder (no engine)."""

import hashlib
import random

import pytest

from rollout_ext.testing import arith, arith_props
from rollout_ext.testing.arith_model import build_arith_model, build_tokenizer, char_ids

# A few optimizer steps, one held-out problem per operand count and short answers: a valid,
# untrained checkpoint in seconds.
SHORT_STEPS = 20
SHORT = {"steps": SHORT_STEPS, "eval_per_operand_count": 1, "eval_max_new_tokens": 32}


def test_problems_are_seeded_and_keep_running_values_in_range():
    first, again = arith.problems(7, 200), arith.problems(7, 200)
    assert first == again
    assert first != arith.problems(8, 200)
    for problem in first:
        values = [problem.operands[0]]
        for op, operand in zip(problem.ops, problem.operands[1:]):
            values.append(values[-1] + operand if op == "+" else values[-1] - operand)
            assert 1 <= operand <= arith.MAX_STEP_OPERAND
        assert all(0 <= v <= arith.MAX_VALUE for v in values)
        assert problem.answer == values[-1]
        assert problem.prompt.startswith("Q:") and problem.prompt.endswith("=")


def test_a_bad_operand_count_names_the_field_and_the_range():
    with pytest.raises(ValueError, match=r"num_operands=9; allowed: 1\.\.8"):
        arith.make_problem(random.Random(0), num_operands=9)


def test_every_training_target_ends_with_the_right_answer_and_some_take_detours():
    rng = random.Random(0)
    texts = []
    for problem in arith.problems(1, 2000):
        text = arith.solution_text(problem, rng)
        texts.append(text)
        assert text.endswith(f"A:{problem.answer}")
        assert arith.is_correct(text, problem.answer)
        assert not arith.is_correct(text, problem.answer + 1)  # control
    for detour in ("wait, ", "check: ", "carry 1", "borrow 1"):
        assert any(detour in text for text in texts), detour
    # Longer chains give longer targets: length follows the prompt.
    by_count = {n: [len(t) for p, t in zip(arith.problems(1, 2000), texts) if p.num_operands == n]
                for n in (2, 8)}
    assert sum(by_count[8]) / len(by_count[8]) > 3 * sum(by_count[2]) / len(by_count[2])


def test_the_answer_is_the_last_one_given():
    assert arith.extract_answer("A:3 wait, A:4") == 4
    assert arith.extract_answer("no answer") is None
    assert arith.extract_answer(None) is None


def test_the_reward_is_correctness_plus_dapos_overlong_penalty():
    def score(text, tokens):
        return arith.compute_score("arith", text, 5, {"response_length": tokens},
                                   max_response_tokens=100, overlong_buffer_tokens=20)["score"]

    assert score("A:5", 80) == 1.0  # at max - buffer: no penalty yet
    assert score("A:5", 90) == pytest.approx(0.5)
    assert score("A:5", 100) == pytest.approx(0.0)
    assert score("A:6", 100) == pytest.approx(-1.0)
    assert score("A:6", 10) == 0.0
    # Without a length, the character count stands in (one token per character).
    assert arith.compute_score("arith", "A:5", "5")["score"] == 1.0
    with pytest.raises(ValueError, match=r"overlong_buffer_tokens=0; allowed: 1\.\.max_response_tokens"):
        arith.overlong_penalty(10, 100, 0)


def test_the_tokenizer_has_one_token_per_character_spaces_and_newlines_included():
    tokenizer = build_tokenizer()
    text = "Q:12+3=12+3=15. A:15\ncheck: x"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(text)
    assert ids == [char_ids(tokenizer)[c] for c in text]
    assert tokenizer.decode(ids) == text


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_build_is_deterministic_and_a_second_run_does_not_rebuild(tmp_path):
    lines = []
    a = build_arith_model(tmp_path / "a", seed=0, progress=lines.append, **SHORT)
    b = build_arith_model(tmp_path / "b", seed=0, progress=lambda _: None, **SHORT)
    c = build_arith_model(tmp_path / "c", seed=1, progress=lambda _: None, **SHORT)
    assert any(line.startswith(f"step {SHORT_STEPS}/{SHORT_STEPS}") for line in lines)
    # An untrained build says so, naming the accuracy and the floor.
    assert any(line.startswith("WARNING: greedy accuracy 0.") and "below 0.9" in line for line in lines), lines
    assert _sha256(a / "model.safetensors") == _sha256(b / "model.safetensors")
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")  # control
    mtimes = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    again = []
    assert build_arith_model(a, seed=0, progress=again.append, **SHORT) == a
    assert again == [] and {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == mtimes


def test_held_out_prompts_cover_every_operand_count_equally():
    problems = arith_props.held_out_problems(64)
    counts = [p.num_operands for p in problems]
    assert all(counts.count(n) == 8 for n in range(1, 9))
    with pytest.raises(ValueError, match="--prompts 4; allowed: at least 8"):
        arith_props.held_out_problems(4)


def test_icc_is_one_when_the_prompt_sets_the_length_and_near_zero_when_it_does_not():
    assert arith_props.icc([[10, 10], [50, 50], [200, 200]]) == pytest.approx(1.0)
    rng = random.Random(0)
    noise = [[rng.randint(10, 200) for _ in range(16)] for _ in range(64)]
    assert arith_props.icc(noise) < 0.15


def test_the_checks_fail_where_they_should():
    problems = arith_props.held_out_problems(8)
    row = lambda tokens, acc: {"tokens": tokens, "acc": acc, "score": acc}  # noqa: E731
    # Half right, a long tail: every check holds.
    good = [[row(10, 1.0), row(10, 0.0), row(10, 1.0), row(60, 0.0)] for _ in problems]
    greedy = [row(10, 1.0) for _ in problems]
    assert all(arith_props.verdict(arith_props.summarize(problems, good, greedy, 512)).values())
    # Controls: every response right, no tail, greedy wrong.
    flat = [[row(10, 1.0)] * 4 for _ in problems]
    wrong = [row(10, 0.0) for _ in problems]
    assert not any(arith_props.verdict(arith_props.summarize(problems, flat, wrong, 512)).values())
