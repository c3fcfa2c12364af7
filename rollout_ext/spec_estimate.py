"""How many tokens per forward pass suffix drafting would give on your own rollouts, model-free.

`python -m rollout_ext spec-estimate ROLLOUT_DIR --tokenizer PATH` reads verl's rollout dumps
(`trainer.rollout_data_dir`: one `<step>.jsonl` per training step, a line per response with its
prompt `input`, its `output` and `step`) and replays every response through a suffix drafter:
at each position the drafter looks up the longest suffix of the text so far (up to
MAX_MATCH_TOKENS) in a corpus and proposes the up to K tokens that followed it there; the pass
accepts the proposed tokens that equal the response's own next tokens, plus one token the
verification produces itself.

Why replaying realized tokens estimates acceptance without bias: with speculative sampling, a
drafted token x at a position is accepted with probability p(x), the target model's probability
of x there (a draft that puts all its mass on x), and the response keeps the target's distribution.
A realized response token at that position is a draw from the same p, so the indicator
[realized == x] has expectation p(x): the acceptance probability. Along a chain, the first k
realized tokens equal the k drafted ones with the product of the conditional probabilities, which
is the probability that speculative sampling accepts k. The drafter itself only reads text that
exists at that moment (the response so far, earlier responses), so replaying it changes nothing.

Corpus sources, each reported on its own and added up:
- own: the prompt and the response so far (what a per-request suffix tree holds);
- siblings: the other responses to the same prompt in the same step that are already finished at
  that position. All samples of a group start together and decode one token per step, so a
  sibling of n tokens is finished from position n on;
- epochs: the responses to the same prompt in earlier steps (the last EPOCHS_KEPT steps, bounded).
Phases: a position is in the tail when at most `tail_share` of the step's responses are still
running at that position (the same clock as above), else in the full batch.
Makespan: the step's decode length in passes (its longest response's) with drafting in the tail
only, over its length in tokens without drafting. It assumes a pass costs what a plain step costs
in the tail (small batches are bound by memory, not by compute) and ignores queueing; the
simulator's step model is the finer estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

MAX_MATCH_TOKENS = 16
MIN_MATCH_TOKENS = 2
EPOCHS_KEPT = 2
SOURCES = ("own", "siblings", "epochs")
BUDGETS = (2, 4, 8, 16)


@dataclasses.dataclass(slots=True)
class Response:
    """One dumped response, tokenized."""

    step: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]


class SuffixIndex:
    """Last occurrence of every n-gram (n = MIN..MAX_MATCH_TOKENS) of the texts added, and what
    followed it: a flat lookup standing in for a suffix tree's longest-match walk. A text may be
    known only up to a length (a response being generated): proposals never read past it."""

    def __init__(self) -> None:
        self._texts: list[tuple[int, ...]] = []
        self._known: list[int] = []
        self._last: dict[tuple[int, ...], tuple[int, int]] = {}

    def add(self, text: tuple[int, ...], known: int | None = None) -> int:
        """Index `text` up to `known` tokens (default: all); returns its handle for `extend`."""
        self._texts.append(text)
        self._known.append(0)
        ref = len(self._texts) - 1
        self.extend(ref, len(text) if known is None else known)
        return ref

    def extend(self, ref: int, known: int) -> None:
        """The text `ref` is known up to `known` tokens. n-grams ending at the last known token are
        left out: a lookup of the current context would find itself, with nothing after it."""
        text, before = self._texts[ref], self._known[ref]
        for end in range(max(before, MIN_MATCH_TOKENS), known):
            for n in range(MIN_MATCH_TOKENS, min(MAX_MATCH_TOKENS, end) + 1):
                self._last[text[end - n:end]] = (ref, end)
        self._known[ref] = max(before, known)

    def propose(self, context: tuple[int, ...], budget: int) -> tuple[int, tuple[int, ...]]:
        """(match length, the up to `budget` known tokens that followed the longest suffix of `context` found)."""
        for n in range(min(MAX_MATCH_TOKENS, len(context)), MIN_MATCH_TOKENS - 1, -1):
            hit = self._last.get(context[-n:])
            if hit is not None:
                ref, end = hit
                draft = self._texts[ref][end:min(end + budget, self._known[ref])]
                if draft:
                    return n, draft
        return 0, ()


def replay(response: Response, siblings: list[Response], earlier: list[Response], budget: int,
           sources: tuple[str, ...], tail_from: int) -> dict:
    """Passes and tokens of one response, by phase, drafting from `sources` with `budget` tokens."""
    shared = SuffixIndex()  # siblings (added as they finish) and earlier epochs
    if "epochs" in sources:
        for other in earlier:
            shared.add(other.prompt + other.tokens)
    waiting = sorted(siblings, key=lambda r: len(r.tokens)) if "siblings" in sources else []
    own = SuffixIndex()
    text = response.prompt + response.tokens
    prompt_len = len(response.prompt)
    own_ref = own.add(text, known=prompt_len)
    counts = {"full": [0, 0], "tail": [0, 0]}  # phase -> [passes, tokens]
    pos = 0
    while pos < len(response.tokens):
        while waiting and len(waiting[0].tokens) <= pos:
            done = waiting.pop(0)
            shared.add(done.prompt + done.tokens)
        context = text[:prompt_len + pos]
        own_match, own_draft = own.propose(context, budget)
        shared_match, shared_draft = shared.propose(context, budget)
        draft = own_draft if own_match >= shared_match else shared_draft
        accepted = 0
        for drafted, actual in zip(draft, response.tokens[pos:]):
            if drafted != actual:
                break
            accepted += 1
        advance = min(accepted + 1, len(response.tokens) - pos)
        phase = counts["tail" if pos >= tail_from else "full"]
        phase[0] += 1
        phase[1] += advance
        pos += advance
        own.extend(own_ref, prompt_len + pos)
    return counts


def tail_start(lengths: list[int], tail_share: float) -> int:
    """The first position at which at most tail_share of the step's responses still run."""
    ordered = sorted(lengths)
    allowed = int(tail_share * len(ordered))
    # Responses longer than p run at position p; the tail starts once at most `allowed` do.
    return ordered[len(ordered) - allowed - 1] if allowed < len(ordered) else 0


def sample_groups(responses: list[Response], max_groups: int) -> list[Response]:
    """In each step, the `max_groups` prompts whose hash is smallest (all when 0). A prompt keeps
    its hash in every step, so one that comes back stays in the sample with its earlier epochs."""
    if not max_groups:
        return responses

    def rank(prompt: tuple[int, ...]) -> bytes:
        return hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()

    by_step: dict[int, set[tuple[int, ...]]] = defaultdict(set)
    for r in responses:
        by_step[r.step].add(r.prompt)
    kept = {step: set(sorted(prompts, key=rank)[:max_groups]) for step, prompts in by_step.items()}
    return [r for r in responses if r.prompt in kept[r.step]]


@dataclasses.dataclass(slots=True)
class _Step:
    """What every replay of one step needs, built once: its responses, where its tail starts, each
    prompt's group, and each prompt's responses in the EPOCHS_KEPT steps before."""

    responses: list[Response]
    tail_from: int
    groups: dict[tuple[int, ...], list[Response]]
    history: dict[tuple[int, ...], list[Response]]


def _steps(responses: list[Response], tail_share: float) -> dict[int, _Step]:
    by_step: dict[int, list[Response]] = defaultdict(list)
    for r in responses:
        by_step[r.step].append(r)
    order = sorted(by_step)
    steps = {}
    for i, step in enumerate(order):
        batch = by_step[step]
        groups: dict[tuple[int, ...], list[Response]] = defaultdict(list)
        for r in batch:
            groups[r.prompt].append(r)
        history: dict[tuple[int, ...], list[Response]] = defaultdict(list)
        for earlier in order[max(0, i - EPOCHS_KEPT):i]:
            for r in by_step[earlier]:
                history[r.prompt].append(r)
        steps[step] = _Step(batch, tail_start([len(r.tokens) for r in batch], tail_share), groups, history)
    return steps


def _row(steps: dict[int, _Step], budget: int, label: str, sources: tuple[str, ...], progress) -> dict:
    """One table row: tokens per pass by phase, and the mean makespan ratio over the steps."""
    totals = {"full": [0, 0], "tail": [0, 0]}  # phase -> [passes, tokens]
    makespans = []
    for plan in steps.values():
        longest_passes = 0
        for r in plan.responses:
            siblings = [s for s in plan.groups[r.prompt] if s is not r]
            counts = replay(r, siblings, plan.history[r.prompt], budget, sources, plan.tail_from)
            for phase, (passes, tokens) in counts.items():
                totals[phase][0] += passes
                totals[phase][1] += tokens
            # Drafting in the tail only: the full-batch positions run one token per pass.
            longest_passes = max(longest_passes, counts["full"][1] + counts["tail"][0])
        longest_tokens = max(len(r.tokens) for r in plan.responses)
        if longest_tokens:
            makespans.append(longest_passes / longest_tokens)
        progress()
    row = {"budget": budget, "sources": label}
    for phase, (passes, tokens) in totals.items():
        row[f"{phase}_tokens_per_pass"] = round(tokens / passes, 3) if passes else None
    passes = totals["full"][0] + totals["tail"][0]
    row["all_tokens_per_pass"] = round((totals["full"][1] + totals["tail"][1]) / passes, 3) if passes else None
    row["makespan_ratio_tail_drafting"] = round(sum(makespans) / len(makespans), 3) if makespans else None
    return row


SOURCE_SETS = {"own": ("own",), "own+siblings": ("own", "siblings"), "own+epochs": ("own", "epochs"),
               "own+siblings+epochs": SOURCES}


def estimate(responses: list[Response], budgets=BUDGETS, tail_share: float = 0.1, progress=None) -> dict:
    """Tokens per pass by budget, source set and phase, and the makespan ratio with tail drafting.
    `progress(done, total)` is called after each (budget, sources, step) replay."""
    steps = _steps(responses, tail_share)
    total, done = len(budgets) * len(SOURCE_SETS) * len(steps), 0

    def step_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    rows = [_row(steps, budget, label, sources, step_done)
            for budget in budgets for label, sources in SOURCE_SETS.items()]
    return {"steps": sorted(steps), "responses": len(responses), "tail_share": tail_share,
            "max_match_tokens": MAX_MATCH_TOKENS, "min_match_tokens": MIN_MATCH_TOKENS,
            "epochs_kept": EPOCHS_KEPT, "rows": rows}


def read_dumps(rollout_dir: Path, tokenizer) -> list[Response]:
    """verl's `<step>.jsonl` files under `rollout_dir`, tokenized."""
    files = sorted(rollout_dir.glob("*.jsonl"), key=lambda p: (len(p.stem), p.stem))
    if not files:
        raise ValueError(f"ROLLOUT_DIR={rollout_dir} has no <step>.jsonl files (verl writes them when "
                         "trainer.rollout_data_dir is set)")
    responses = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            missing = [k for k in ("input", "output") if k not in entry]
            if missing:
                raise ValueError(f"{path}:{number}: no {', '.join(missing)} field; verl's rollout dump has "
                                 "input, output, step")
            step = int(entry.get("step", path.stem))
            responses.append(Response(step, tuple(tokenizer.encode(entry["input"], add_special_tokens=False)),
                                      tuple(tokenizer.encode(entry["output"], add_special_tokens=False))))
    return responses


def format_table(result: dict) -> str:
    lines = [f"{result['responses']} responses over steps {result['steps'][0]}..{result['steps'][-1]}; "
             f"tail: at most {result['tail_share']:.0%} of a step's responses still running",
             f"{'budget':>6} {'sources':<22} {'full':>6} {'tail':>6} {'all':>6} {'makespan':>9}  (tokens per pass; "
             "makespan with drafting in the tail, over without)"]
    for row in result["rows"]:
        cells = [row["full_tokens_per_pass"], row["tail_tokens_per_pass"], row["all_tokens_per_pass"]]
        text = " ".join(f"{c:>6.2f}" if c is not None else f"{'-':>6}" for c in cells)
        ratio = row["makespan_ratio_tail_drafting"]
        lines.append(f"{row['budget']:>6} {row['sources']:<22} {text} {ratio if ratio is not None else '-':>9}")
    return "\n".join(lines)


def run(args) -> int:
    from transformers import AutoTokenizer

    if not 0 <= args.tail_share < 1:
        print(f"--tail-share={args.tail_share}; allowed: 0 <= share < 1", file=sys.stderr)
        return 2
    if args.max_groups < 0:
        print(f"--max-groups={args.max_groups}; allowed: 0 (all) or a positive number of prompts", file=sys.stderr)
        return 2
    rollout_dir = Path(args.rollout_dir)
    if not rollout_dir.is_dir():
        print(f"ROLLOUT_DIR={rollout_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        responses = read_dumps(rollout_dir, AutoTokenizer.from_pretrained(args.tokenizer))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    responses = sample_groups(responses, args.max_groups)
    started_s = time.monotonic()

    def progress(done: int, total: int) -> None:
        print(f"\rreplayed {done}/{total} (budget x sources x step), {time.monotonic() - started_s:.0f} s",
              end="" if done < total else "\n", file=sys.stderr, flush=True)

    result = estimate(responses, tuple(args.budget or BUDGETS), args.tail_share, progress)
    result["max_groups"] = args.max_groups
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("spec-estimate", help="tokens per pass that suffix drafting would give on verl rollout dumps")
    p.add_argument("rollout_dir", metavar="ROLLOUT_DIR", help="verl's trainer.rollout_data_dir (<step>.jsonl files)")
    p.add_argument("--tokenizer", required=True, help="the policy's tokenizer (a local folder)")
    p.add_argument("--budget", type=int, action="append", help=f"draft tokens per pass (repeatable; default {BUDGETS})")
    p.add_argument("--tail-share", type=float, default=0.1,
                   help="a position is in the tail when at most this share of the step's responses still run")
    p.add_argument("--max-groups", type=int, default=0,
                   help="replay at most this many prompts per step (chosen by hash, so a prompt that "
                        "comes back is chosen again; 0: all)")
    p.add_argument("--json", help="also write the table as JSON here")
    p.set_defaults(func=run)
