"""What equivalence tests share: prompts, the all-modules-off environment, and the comparison."""

from __future__ import annotations

from rollout_ext import modules
from rollout_ext.testing.greedy import GreedyResult, GreedySpec

# Mixed lengths: a long prompt exceeds small token thresholds and, with a small batch budget,
# is prefilled in several chunks; short ones decode beside it.
PROMPTS = [
    [(7 * i + 3) % 900 + 10 for i in range(150)],
    [11, 23, 5, 77, 301, 42, 8],
    [(13 * i) % 700 + 50 for i in range(37)],
    [500],
]
MAX_TOKENS = 12
MAX_NUM_BATCHED_TOKENS = 64

# Plugin loaded, every module off: the reference every module is compared with.
OFF_ENV = {"VLLM_PLUGINS": "rollout_ext", **modules.off_env()}


def module_env(**switches: str) -> dict[str, str]:
    """OFF_ENV with the given ROLLOUT_EXT_<NAME>=value switches, e.g. module_env(ROPE_CACHE="1")."""
    return {**OFF_ENV, **{f"ROLLOUT_EXT_{k.upper()}": v for k, v in switches.items()}}


def make_spec(model_dir, tp: int, eager: bool) -> GreedySpec:
    return GreedySpec(
        model=str(model_dir),
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
        tp=tp,
        enforce_eager=eager,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )


def assert_equivalent(result: GreedyResult, reference: GreedyResult, atol: float = 1e-3) -> None:
    """Token-identical greedy output; the chosen tokens' log-probs agree within atol (fp32)."""
    assert result.tokens == reference.tokens
    for req, (steps, ref_steps) in enumerate(zip(result.logprobs, reference.logprobs)):
        for step, (got, ref) in enumerate(zip(steps, ref_steps)):
            token = reference.tokens[req][step]
            assert abs(got[token] - ref[token]) <= atol, (req, step, got[token], ref[token])
