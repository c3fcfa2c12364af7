"""Tail drafting: suffix drafting only when few sequences still run, more drafts for the longest.

Replaces: `vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose` (vllm-ascend main's
`AscendSuffixDecodingProposer.propose` calls it through `super().propose`), and fills the engine's
`speculative_config` before vLLM builds it (through engine_config_check's `prepare_engine_args`).
Why: drafting only pays where the running batch is small, which is the rollout's tail; in a full
batch, verifying drafts costs what it saves. vLLM already picks a per-step K from a batch-size
schedule (`num_speculative_tokens_per_batch_size`, the scheduler's `num_spec_tokens_to_schedule`),
but the suffix proposer asserts that the step's K equals the configured one
(suffix_decoding.py:44), so any schedule crashes it. The wrapper lets the step's K through and
caps each sequence's draft by how long it has run: the longest-running sequence gets the step's K,
a sequence that has run a fraction f of that gets ceil(f * K) (the stragglers decide the makespan).
With ROLLOUT_EXT_TAIL_DRAFTING=1 the engine drafts with suffix decoding (arctic-inference),
ROLLOUT_EXT_DRAFT_TOKENS per step while at most ROLLOUT_EXT_TAIL_BATCH_SEQS sequences run, none above.
Targets: vllm>=0.23,<0.28 (propose(self, num_speculative_tokens, input_batch, sampled_token_ids,
...), the assert on the configured K). Undo: revert(). Remove when vLLM's suffix proposer honours
the scheduled K (then keep only the per-sequence cap, or drop it if the drafter weighs length).
"""

from __future__ import annotations

import math

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._base import PatchError, Swaps, require_signature, require_vllm
from rollout_ext.patches._counters import Counters

NAME = "tail_drafting"
_swaps = Swaps(NAME)
_PARAMS = ["num_speculative_tokens", "input_batch", "sampled_token_ids"]


def draft_caps(step_tokens: int, output_lens: list[int]) -> list[int]:
    """Each sequence's draft cap in one step: `step_tokens` for the longest-running, ceil(f * step_tokens)
    for one that has run a fraction f of its output length, at least 1; none when the step drafts none."""
    if step_tokens <= 0:
        return [0] * len(output_lens)
    longest = max(output_lens, default=0)
    if longest <= 0:
        return [step_tokens] * len(output_lens)
    return [max(1, math.ceil(step_tokens * n / longest)) for n in output_lens]


def schedule(draft_tokens: int, tail_batch_seqs: int) -> list[list[int]]:
    """vLLM's batch-size schedule: `draft_tokens` per step up to `tail_batch_seqs` running, 0 above."""
    return [[1, tail_batch_seqs, draft_tokens], [tail_batch_seqs + 1, max(tail_batch_seqs + 1, 1 << 20), 0]]


def prepare_engine_args(cfg, engine_args) -> None:
    """Suffix drafting with the tail schedule, unless the user's speculative_config says otherwise
    (a method other than suffix is a conflict; their own K or schedule are kept)."""
    spec = dict(engine_args.speculative_config or {})
    method = spec.setdefault("method", "suffix")
    if method != "suffix":
        from rollout_ext.config import ConfigError

        raise ConfigError(
            f"ROLLOUT_EXT_TAIL_DRAFTING=1 drafts with suffix decoding, but speculative_config has "
            f"method={method!r}. Drop speculative_config's method (or set it to 'suffix'), or set "
            f"ROLLOUT_EXT_TAIL_DRAFTING=0.")
    spec.setdefault("num_speculative_tokens", cfg.draft_tokens)
    spec.setdefault("num_speculative_tokens_per_batch_size",
                    schedule(spec["num_speculative_tokens"], cfg.tail_batch_seqs))
    engine_args.speculative_config = spec


def _output_lens(input_batch, rows: int) -> list[int]:
    return [int(input_batch.num_tokens_no_spec[i]) - int(input_batch.num_prompt_tokens[i]) for i in range(rows)]


def _wrap(original):
    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
        configured = self.num_speculative_tokens
        self.num_speculative_tokens = num_speculative_tokens  # what upstream asserts on and caps with
        try:
            drafts = original(self, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
        finally:
            self.num_speculative_tokens = configured
        caps = draft_caps(num_speculative_tokens, _output_lens(input_batch, len(drafts)))
        COUNTERS.add("steps")
        COUNTERS.add("drafted_steps", int(num_speculative_tokens > 0))
        COUNTERS.add("draft_tokens", sum(min(len(d), c) for d, c in zip(drafts, caps)))
        return [list(d[:c]) for d, c in zip(drafts, caps)]

    return propose


# Per process: proposer steps, steps with K > 0, draft tokens proposed.
COUNTERS = Counters("steps", "drafted_steps", "draft_tokens")


def _require_arctic() -> None:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError as e:
        raise PatchError(
            f"rollout_ext patch {NAME!r}: suffix drafting needs arctic-inference, which is not importable "
            f"({e}). `make setup` builds it; by hand: see README (Tail drafting)") from e


def check_upstream() -> None:
    """On vllm-ascend: its suffix proposer must still reach vLLM's through super().propose, and its
    runner must still pass the scheduled K to it (else the batch-size schedule never arrives)."""
    from rollout_ext.platform import stack

    if stack() == "vllm":
        return
    from rollout_ext.patches._ascend import ascend_label, keyword_passed, require_hook, require_super_call

    cls = require_hook(NAME, "vllm_ascend.spec_decode.suffix_proposer", "AscendSuffixDecodingProposer")
    require_super_call(NAME, cls, "propose", "the scheduled K reaches vLLM's SuffixDecodingProposer.propose")
    runner = require_hook(NAME, "vllm_ascend.worker.model_runner_v1", "NPUModelRunner.propose_draft_token_ids")
    if not keyword_passed(runner, "propose", "num_speculative_tokens"):
        raise PatchError(f"rollout_ext patch {NAME!r}: {ascend_label()}: NPUModelRunner.propose_draft_token_ids no "
                         f"longer passes num_speculative_tokens to its proposer's propose (the scheduled K) "
                         f"(missing hook); this binding needs updating")


def apply(cfg=None) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    _require_arctic()
    from rollout_ext.patches._ascend import calls_named
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    original = SuffixDecodingProposer.propose
    require_signature(NAME, original, _PARAMS)
    if not calls_named(original, "speculate"):
        raise PatchError(f"rollout_ext patch {NAME!r}: SuffixDecodingProposer.propose no longer calls the suffix "
                         f"cache's speculate (vllm {require_vllm(NAME)}); the upstream code moved")
    check_upstream()
    _swaps.replace(SuffixDecodingProposer, "propose", _wrap(original))
    return ACTIVE


def revert() -> None:
    _swaps.revert()
    COUNTERS.reset()
