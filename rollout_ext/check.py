"""`python -m rollout_ext check`: do the chosen modules change greedy output on YOUR model?

Runs real vLLM in fresh processes — once with every module off, then once per variant — with the
same token-id prompts, and compares tokens and the chosen tokens' log-probs. Use it on a new model
shape before a long job; exit status 0 means every variant's modules were active in every process
that loaded the plugin (its status line says so), and its output was token-identical.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from rollout_ext import modules
from rollout_ext.config import ConfigError, ExtConfig
from rollout_ext.plugin import status_lines
from rollout_ext.testing.equivalence import OFF_ENV
from rollout_ext.testing.greedy import GreedySpec, run_greedy


def prompts_for(model: Path, num_prompts: int, seed: int) -> list[list[int]]:
    """Token-id prompts of mixed lengths (one long enough to be prefilled in chunks)."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    lengths = [150, 7, 37, 1] + [rng.randint(2, 96) for _ in range(max(0, num_prompts - 4))]
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths[:num_prompts]]


def parse_switches(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected ROLLOUT_EXT_NAME=VALUE")
        env[key] = value
    return env


def variant_env(name: str) -> dict[str, str]:
    """'rope_cache+flashcomm' -> the switches that turn those modules on."""
    names = name.split("+")
    for module in names:
        if module not in modules.BY_NAME:
            raise ValueError(f"--variant {name!r}: unknown module {module!r}; known: {', '.join(modules.NAMES)}")
    return modules.switches_on(names)


def not_bound(log: str, wanted: list[str]) -> list[str]:
    """The wanted modules that some process's status line did not list as active (all of them if no
    process reported)."""
    lines = status_lines(log)
    return [name for name in wanted if not lines or any(name not in line["active"] for line in lines)]


def drafted_nothing(on, wanted: list[str]) -> list[str]:
    """Drafting modules whose run verified no draft token: equal output would prove nothing."""
    return [name for name in wanted if modules.get(name).drafts and not on.spec_decode.get("draft_tokens")]


def compare(on, off) -> dict:
    differing = [i for i, (a, b) in enumerate(zip(on.tokens, off.tokens)) if a != b]
    max_diff = 0.0
    for req, (steps, ref_steps) in enumerate(zip(on.logprobs, off.logprobs)):
        if req in differing:
            continue
        for step, (got, ref) in enumerate(zip(steps, ref_steps)):
            token = off.tokens[req][step]
            max_diff = max(max_diff, abs(got[token] - ref[token]))
    return {"identical": not differing, "differing_requests": differing, "max_logprob_diff": max_diff}


def run_check(args) -> int:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"--model {args.model!r}: no config.json there; pass a local HF checkpoint folder", file=sys.stderr)
        return 2
    try:
        common = parse_switches(args.set)
        variants = {name: {**OFF_ENV, **common, **variant_env(name)} for name in args.variant or ["rope_cache"]}
        for env in variants.values():
            ExtConfig.from_env(env)
    except (ValueError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 2
    spec = GreedySpec(
        model=str(model), prompts=prompts_for(model, args.num_prompts, args.seed), max_tokens=args.max_tokens,
        tp=args.tp, enforce_eager=args.enforce_eager, dtype=args.dtype, max_num_batched_tokens=64,
        rope_counters=False,
    )
    mode = "eager" if args.enforce_eager else "compiled"
    print(f"check: {model} tp={args.tp} {mode} {args.dtype}; variants {list(variants)}; with {common}")
    off = run_greedy(spec, OFF_ENV)
    failed = []
    for name, env in variants.items():
        on = run_greedy(spec, env)
        wanted = name.split("+")
        result = {**compare(on, off), "not_bound": not_bound(on.log, wanted) + drafted_nothing(on, wanted),
                  "spec_decode": on.spec_decode}
        verdict = "IDENTICAL" if result["identical"] else "DIFFERENT"
        if result["not_bound"]:
            # Equal output proves nothing about a module that never hooked the code that ran.
            verdict = f"NOT BOUND ({','.join(result['not_bound'])})"
        print(f"{name}: {verdict} {json.dumps(result)}")
        if verdict != "IDENTICAL":
            failed.append(name)
    print(f"check: {len(variants) - len(failed)}/{len(variants)} variants bound and token-identical to all-off")
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="compare greedy output with modules on vs all off on a local model")
    p.add_argument("--model", required=True, help="local HF checkpoint folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--variant", action="append", metavar="MODULE[+MODULE]",
                   help=f"modules to switch on together, e.g. rope_cache+flashcomm (repeatable; default rope_cache); modules: {', '.join(modules.NAMES)}")
    p.add_argument("--set", action="append", default=[], metavar="ROLLOUT_EXT_NAME=VALUE",
                   help="an extra setting for every variant run, e.g. ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS=1")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_check)
