"""spec-estimate without a model: the suffix replay on responses whose structure is known."""

from __future__ import annotations

import json
import random

import pytest

from rollout_ext.__main__ import main
from rollout_ext.spec_estimate import Response, SuffixIndex, estimate, read_dumps, replay, sample_groups, tail_start

NO_TAIL = 10**9


def test_a_draft_never_reads_past_what_is_known():
    index = SuffixIndex()
    text = (1, 2, 3, 1, 2, 3, 4)
    ref = index.add(text, known=5)  # 1 2 3 1 2 known; 3 4 not generated yet
    assert index.propose((9, 1, 2), budget=8) == (2, (3, 1, 2))  # after the first "1 2": up to the known end
    index.extend(ref, 7)
    assert index.propose((9, 1, 2), budget=8) == (2, (3, 4))  # the most recent "1 2" wins
    assert index.propose((7, 7), budget=8) == (0, ())


def test_own_text_siblings_and_earlier_epochs_each_draft():
    prompt = (50, 51)
    loop = tuple([1, 2, 3, 4, 5, 6, 7, 8] * 4)
    assert replay(Response(1, prompt, loop), [], [], 8, ("own",), NO_TAIL)["full"] == [13, 32]
    # A response that never repeats itself drafts nothing from its own text...
    fresh = Response(2, prompt, tuple(range(100, 140)))
    assert replay(fresh, [], [], 8, ("own",), NO_TAIL)["full"] == [40, 40]
    # ...but the same text from the previous epoch drafts 8 + 1 tokens a pass.
    earlier = Response(1, prompt, fresh.tokens)
    assert replay(fresh, [], [earlier], 8, ("own", "epochs"), NO_TAIL)["full"] == [5, 40]
    # A sibling helps only once it has finished: a short one that shares the opening is done too
    # late for it, a short one that shares the ending drafts it.
    opening = Response(2, prompt, fresh.tokens[:10])
    assert replay(fresh, [opening], [], 8, ("own", "siblings"), NO_TAIL)["full"] == [40, 40]
    ending = Response(2, prompt, fresh.tokens[15:])  # 25 tokens: finished at position 25, its text = positions 15..39
    passes, tokens = replay(fresh, [ending], [], 8, ("own", "siblings"), NO_TAIL)["full"]
    assert tokens == 40 and passes < 40


def test_tail_starts_where_at_most_the_share_still_runs():
    assert tail_start(list(range(1, 11)), 0.1) == 9  # at 9 only the 10-token response runs
    assert tail_start(list(range(1, 11)), 0.0) == 10  # nothing runs: no tail positions at all
    counts = replay(Response(1, (5,), tuple(range(20, 30))), [], [], 4, ("own",), tail_from=6)
    assert counts == {"full": [6, 6], "tail": [4, 4]}


def _batch(step: int, texts: list[tuple[int, ...]], prompts: int, samples: int) -> list[Response]:
    return [Response(step, (p,), texts[p * samples + s]) for p in range(prompts) for s in range(samples)]


def test_repetitive_groups_draft_and_random_ones_do_not():
    rng = random.Random(0)
    prompts, samples = 4, 4
    # Each prompt's samples end the same way and start at different points (siblings resemble each
    # other): the shorter ones finish first, holding the ending the longer ones still have to write.
    chains = [tuple(rng.randrange(1000) for _ in range(60)) for _ in range(prompts)]
    similar = [chains[p][10 * s:] for p in range(prompts) for s in range(samples)]

    def random_texts():
        return [tuple(rng.randrange(10**6) for _ in range(60 - 10 * s)) for _ in range(prompts) for s in range(samples)]

    # Two steps: the similar responses repeat in step 2 (the same prompt answered again); random
    # ones are new in every step.
    for texts, again, low, high in ((similar, similar, 1.5, 10.0), (random_texts(), random_texts(), 1.0, 1.0)):
        responses = _batch(1, texts, prompts, samples) + _batch(2, again, prompts, samples)
        result = estimate(responses, budgets=(8,), tail_share=0.25)
        rows = {row["sources"]: row for row in result["rows"]}
        best = rows["own+siblings+epochs"]
        assert low <= best["all_tokens_per_pass"] <= high, rows
        assert rows["own"]["all_tokens_per_pass"] == pytest.approx(1.0, abs=0.05)  # nothing repeats within one
        if texts is similar:  # the control above: random text stays at one token per pass
            assert best["tail_tokens_per_pass"] > 2 and best["makespan_ratio_tail_drafting"] < 1
            assert rows["own+siblings"]["all_tokens_per_pass"] > rows["own"]["all_tokens_per_pass"]
        else:
            assert best["makespan_ratio_tail_drafting"] == 1.0


class _Chars:
    """A character tokenizer: what read_dumps needs of a Hugging Face one."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_read_dumps_reads_verls_files_and_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no <step>.jsonl files"):
        read_dumps(tmp_path, _Chars())
    lines = [{"input": "Q:1+2=", "output": "1+2=3. A:3", "gts": 3, "score": 1.0, "step": 1, "uid": "a_0_0"}]
    (tmp_path / "1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "10.jsonl").write_text(json.dumps({**lines[0], "step": 10}) + "\n")
    (tmp_path / "2.jsonl").write_text(json.dumps({**lines[0], "step": 2}) + "\n")
    responses = read_dumps(tmp_path, _Chars())
    assert [r.step for r in responses] == [1, 2, 10]  # steps in numeric order
    assert responses[0].prompt == tuple(map(ord, "Q:1+2=")) and len(responses[0].tokens) == 10
    (tmp_path / "3.jsonl").write_text(json.dumps({"input": "x", "step": 3}) + "\n")
    with pytest.raises(ValueError, match=r"3.jsonl:1: no output field"):
        read_dumps(tmp_path, _Chars())


def test_cli_refuses_bad_input_naming_it(tmp_path, capsys):
    assert main(["spec-estimate", str(tmp_path / "missing"), "--tokenizer", "x"]) == 2
    assert "ROLLOUT_DIR=" in capsys.readouterr().err
    assert main(["spec-estimate", str(tmp_path), "--tokenizer", "x", "--tail-share", "1.5"]) == 2
    assert "--tail-share=1.5" in capsys.readouterr().err
    assert main(["spec-estimate", str(tmp_path), "--tokenizer", "x", "--max-groups", "-1"]) == 2
    assert "--max-groups=-1" in capsys.readouterr().err


def test_a_group_sample_keeps_whole_prompts_across_steps():
    responses = [Response(step, (p,), (1, 2, 3)) for step in (1, 2) for p in range(10) for _ in range(4)]
    kept = sample_groups(responses, 3)
    prompts = {r.prompt for r in kept}
    assert len(prompts) == 3 and len(kept) == 3 * 4 * 2  # every sample of a kept prompt, in both steps
    assert sample_groups(responses, 3) == kept and sample_groups(responses, 0) == responses
    # New prompts in every step (as a dataset epoch runs): each step still keeps 3.
    fresh = [Response(step, (step, p), (1, 2, 3)) for step in (1, 2) for p in range(10) for _ in range(4)]
    assert len({(r.step, r.prompt) for r in sample_groups(fresh, 3)}) == 6
    calls = []
    estimate(kept, budgets=(4,), progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (8, 8) and len(calls) == 8  # 1 budget x 4 source sets x 2 steps
