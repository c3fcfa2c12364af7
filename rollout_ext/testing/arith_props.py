"""What rollouts of the arithmetic model look like: lengths, their spread, the reward, DAPO's filter.

Samples `--samples` responses to each of `--prompts` held-out prompts (an equal number per operand
count) at temperature 1 through real vLLM, plus one greedy response per prompt, and prints:
- response length (tokens) mean, p50, p90, p99, max and the share that hit the cap, overall and by
  operand count;
- ICC: the between-prompt share of the variance of log length (1 = the prompt sets the length,
  0 = siblings vary as much as prompts do);
- reward mean (rollout_ext.testing.arith.compute_score: correctness plus DAPO's overlong penalty),
  sampled accuracy, greedy accuracy;
- the share of groups DAPO's dynamic sampling would drop (every sample equally correct);
- the same for the greedy responses, as a control: their lengths follow the prompt alone.

CLI: python -m rollout_ext.testing.arith_props [--model DIR] [--prompts 64] [--samples 16]
     [--max-tokens 512] [--speculative off|ngram] [--json PATH]
VLLM_ENABLE_V1_MULTIPROCESSING=0 in its environment saves the engine core's second process (one vLLM
import, about 10 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from rollout_ext.testing import arith

PROMPT_SEED = 2_000_003  # held out: training and the build's evaluation use other seeds
KV_CACHE_BYTES = 256 * 2**20

# What the test and `make setup` hold the model to (see tests/integration/test_arith_model.py).
MIN_GREEDY_ACCURACY = 0.6
REWARD_RANGE = (0.1, 0.9)
MIN_P99_OVER_P50 = 3.0


def held_out_problems(num_prompts: int, seed: int = PROMPT_SEED) -> list[arith.Problem]:
    """num_prompts problems, operand counts 1..8 in turn, so every count gets an equal share."""
    counts = range(arith.MIN_OPERANDS, arith.MAX_OPERANDS + 1)
    if num_prompts < len(counts):
        raise ValueError(f"--prompts {num_prompts}; allowed: at least {len(counts)} (one per operand count)")
    per_count = {n: iter(arith.problems(seed + n, math.ceil(num_prompts / len(counts)), num_operands=n))
                 for n in counts}
    return [next(per_count[counts[i % len(counts)]]) for i in range(num_prompts)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..100."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def length_stats(lengths: list[int], cap: int) -> dict:
    return {
        "n": len(lengths),
        "mean": round(statistics.fmean(lengths), 1),
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": max(lengths),
        "cap_share": round(sum(length >= cap for length in lengths) / len(lengths), 4),
    }


def icc(groups: list[list[int]]) -> float:
    """Between-group share of the variance of log length (groups of equal size)."""
    logs = [[math.log(max(1, x)) for x in group] for group in groups]
    everything = [x for group in logs for x in group]
    total = statistics.pvariance(everything)
    if total == 0:
        return float("nan")
    between = statistics.pvariance([statistics.fmean(group) for group in logs])
    return between / total


def summarize(problems: list[arith.Problem], samples: list[list[dict]], greedy: list[dict],
              cap: int) -> dict:
    """samples[i]: the responses to problems[i], each {"tokens", "acc", "score"}; greedy[i] one such."""
    lengths = [r["tokens"] for group in samples for r in group]
    by_count = {}
    for count in sorted({p.num_operands for p in problems}):
        rows = [r for p, group in zip(problems, samples) if p.num_operands == count for r in group]
        by_count[count] = {**length_stats([r["tokens"] for r in rows], cap),
                           "reward": round(statistics.fmean(r["score"] for r in rows), 3),
                           "acc": round(statistics.fmean(r["acc"] for r in rows), 3)}
    overall = length_stats(lengths, cap)
    return {
        "lengths": overall,
        "by_num_operands": by_count,
        "icc_log_length": round(icc([[r["tokens"] for r in group] for group in samples]), 3),
        "reward_mean": round(statistics.fmean(r["score"] for group in samples for r in group), 3),
        "sampled_accuracy": round(statistics.fmean(r["acc"] for group in samples for r in group), 3),
        "greedy_accuracy": round(statistics.fmean(r["acc"] for r in greedy), 3),
        "dapo_filtered_share": round(
            sum(len({r["acc"] for r in group}) == 1 for group in samples) / len(samples), 3),
        "p99_over_p50": round(overall["p99"] / overall["p50"], 2),
    }


def verdict(summary: dict) -> dict[str, bool]:
    low, high = REWARD_RANGE
    return {
        f"greedy_accuracy >= {MIN_GREEDY_ACCURACY}": summary["greedy_accuracy"] >= MIN_GREEDY_ACCURACY,
        f"{low} <= reward_mean <= {high}": low <= summary["reward_mean"] <= high,
        f"p99 >= {MIN_P99_OVER_P50} x p50": summary["p99_over_p50"] >= MIN_P99_OVER_P50,
    }


# Drafting methods that need no draft model; ngram drafts from the request's own text.
SPECULATIVE = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}


def sample(model: str, problems: list[arith.Problem], samples_per_prompt: int, max_tokens: int,
           seed: int, speculative: str = "off") -> tuple[list[list[dict]], list[dict], dict[str, int]]:
    """Runs vLLM in this process: n samples at temperature 1 and one greedy response per prompt.

    The engine's seed makes the run repeatable. A per-request seed would not: every prompt would
    then draw the same random numbers, and their samples would be correlated.
    """
    from vllm import LLM, SamplingParams

    from rollout_ext.testing.greedy import spec_decode_counts

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=seed, max_model_len=1024,
              kv_cache_memory_bytes=KV_CACHE_BYTES, speculative_config=SPECULATIVE[speculative],
              disable_log_stats=False)
    prompts = [p.prompt for p in problems]

    def score(problem: arith.Problem, completion) -> dict:
        tokens = len(completion.token_ids)
        result = arith.compute_score("arith", completion.text, problem.answer,
                                     {"response_length": tokens}, max_response_tokens=max_tokens)
        return {"tokens": tokens, "acc": result["acc"], "score": result["score"], "text": completion.text}

    sampled = llm.generate(prompts, SamplingParams(n=samples_per_prompt, temperature=1.0,
                                                   max_tokens=max_tokens), use_tqdm=False)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return ([[score(p, c) for c in out.outputs] for p, out in zip(problems, sampled)],
            [score(p, out.outputs[0]) for p, out in zip(problems, greedy)], spec_decode_counts(llm.get_metrics()))


def format_table(summary: dict) -> str:
    head = f"{'operands':>8} {'n':>5} {'mean':>6} {'p50':>5} {'p90':>5} {'p99':>5} {'max':>5} {'cap%':>5} {'acc':>5} {'reward':>6}"
    lines = [head]
    for count, row in summary["by_num_operands"].items():
        lines.append(f"{count:>8} {row['n']:>5} {row['mean']:>6.1f} {row['p50']:>5.0f} {row['p90']:>5.0f} "
                     f"{row['p99']:>5.0f} {row['max']:>5} {100 * row['cap_share']:>5.1f} {row['acc']:>5.2f} "
                     f"{row['reward']:>6.3f}")
    o = summary["lengths"]
    lines.append(f"{'all':>8} {o['n']:>5} {o['mean']:>6.1f} {o['p50']:>5.0f} {o['p90']:>5.0f} {o['p99']:>5.0f} "
                 f"{o['max']:>5} {100 * o['cap_share']:>5.1f} {summary['sampled_accuracy']:>5.2f} "
                 f"{summary['reward_mean']:>6.3f}")
    lines.append(f"ICC of log length {summary['icc_log_length']}; greedy accuracy {summary['greedy_accuracy']}; "
                 f"groups DAPO would filter {summary['dapo_filtered_share']}; p99/p50 {summary['p99_over_p50']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from rollout_ext.testing.arith_model import default_arith_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_arith_dir())
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts (at least 8)")
    parser.add_argument("--samples", type=int, default=16, help="responses per prompt at temperature 1")
    parser.add_argument("--max-tokens", type=int, default=arith.MAX_RESPONSE_TOKENS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative", choices=tuple(SPECULATIVE), default="off",
                        help="draft tokens while sampling (lossless: the distribution must not change)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--examples", type=int, default=2, help="sample responses to print")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; build it with "
                     f"python -m rollout_ext.testing.tiny_model --arch qwen2 --task arith --out {args.model}")
    for name in ("prompts", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}; allowed: >= 1")
    problems = held_out_problems(args.prompts)

    start_s = time.perf_counter()
    samples, greedy, spec_decode = sample(str(args.model), problems, args.samples, args.max_tokens, args.seed,
                                          args.speculative)
    elapsed_s = time.perf_counter() - start_s
    summary = summarize(problems, samples, greedy, args.max_tokens)
    checks = verdict(summary)
    # The control for the checks: the greedy responses, one per prompt, as if they were the samples.
    # Their lengths follow the prompt alone, so the tail that sampling adds is missing.
    greedy_summary = summarize(problems, [[r] for r in greedy], greedy, args.max_tokens)
    print(format_table(summary))
    for i in range(min(args.examples, len(problems))):
        print(f"example {i + 1}: {problems[-1 - i].prompt}{samples[-1 - i][0]['text']}")
    print("checks: " + "; ".join(f"{name}: {'ok' if ok else 'FAIL'}" for name, ok in checks.items()))
    g = greedy_summary["lengths"]
    print(f"greedy responses (control): length p50 {g['p50']:.0f} p99 {g['p99']:.0f} (p99/p50 "
          f"{greedy_summary['p99_over_p50']}), reward {greedy_summary['reward_mean']}")
    print(f"sampled {args.prompts} x {args.samples} + {args.prompts} greedy in {elapsed_s:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "setup": {"model": str(args.model), "prompts": args.prompts, "samples": args.samples,
                      "max_tokens": args.max_tokens, "seed": args.seed, "prompt_seed": PROMPT_SEED,
                      "speculative": args.speculative,
                      "temperature": 1.0},
            "summary": summary, "checks": checks, "elapsed_s": round(elapsed_s, 1), "spec_decode": spec_decode,
            "greedy_summary": greedy_summary, "greedy_checks": verdict(greedy_summary),
            "lengths": [[r["tokens"] for r in group] for group in samples],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
