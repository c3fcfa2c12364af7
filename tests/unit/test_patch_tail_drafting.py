"""patches/tail_drafting.py on vLLM's own SuffixDecodingProposer, arctic-inference's suffix cache,
vLLM's batch-size schedule builder and vLLM's EngineArgs; unpatched vLLM is the control."""

from __future__ import annotations

import pytest

from rollout_ext.config import ConfigError, ExtConfig
from rollout_ext.patches import tail_drafting
from rollout_ext.testing import drafting


def test_the_longest_running_sequence_gets_the_steps_draft_budget():
    assert tail_drafting.draft_caps(8, [100, 50, 10, 0]) == [8, 4, 1, 1]
    assert tail_drafting.draft_caps(8, [0, 0]) == [8, 8]
    assert tail_drafting.draft_caps(0, [100, 5]) == [0, 0]


def test_the_schedule_is_vllms_own_dense_lookup():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup(tail_drafting.schedule(8, 4), vllm_max_batch_size=32,
                                              vllm_num_speculative_tokens=8)
    assert lookup[1:5] == [8] * 4 and lookup[5:] == [0] * 28
    # A tail threshold above the engine's batch drafts at every batch size.
    assert build_dynamic_sd_schedule_lookup(tail_drafting.schedule(8, 64), vllm_max_batch_size=32,
                                            vllm_num_speculative_tokens=8)[1:] == [8] * 32


def test_engine_args_get_suffix_drafting_with_the_tail_schedule(monkeypatch, tiny_qwen2):
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs

    # EngineArgs loads vLLM's general plugins (rollout_ext's among them) once per process; this
    # test calls the patch's hook itself and leaves the process unpatched.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)
    cfg = ExtConfig.from_env({"ROLLOUT_EXT_TAIL_DRAFTING": "1", "ROLLOUT_EXT_DRAFT_TOKENS": "6",
                              "ROLLOUT_EXT_TAIL_BATCH_SEQS": "3"})
    args = EngineArgs(model=str(tiny_qwen2))
    tail_drafting.prepare_engine_args(cfg, args)
    assert args.speculative_config == {"method": "suffix", "num_speculative_tokens": 6,
                                       "num_speculative_tokens_per_batch_size": [[1, 3, 6], [4, 1 << 20, 0]]}
    # The user's own K is kept, and the schedule follows it.
    args = EngineArgs(model=str(tiny_qwen2), speculative_config={"method": "suffix", "num_speculative_tokens": 12})
    tail_drafting.prepare_engine_args(cfg, args)
    assert args.speculative_config["num_speculative_tokens_per_batch_size"][0] == [1, 3, 12]
    args = EngineArgs(model=str(tiny_qwen2), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with pytest.raises(ConfigError, match="ROLLOUT_EXT_TAIL_DRAFTING=1 .* method='ngram'"):
        tail_drafting.prepare_engine_args(cfg, args)


def test_bad_draft_settings_name_the_variable():
    with pytest.raises(ConfigError, match="ROLLOUT_EXT_DRAFT_TOKENS='0' is not allowed"):
        ExtConfig.from_env({"ROLLOUT_EXT_DRAFT_TOKENS": "0"})
    with pytest.raises(ConfigError, match="ROLLOUT_EXT_TAIL_BATCH_SEQS='many' is not allowed"):
        ExtConfig.from_env({"ROLLOUT_EXT_TAIL_BATCH_SEQS": "many"})


def _proposer(configured_tokens: int):
    """vLLM's SuffixDecodingProposer with arctic-inference's cache, built without an engine config."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    proposer = object.__new__(SuffixDecodingProposer)
    proposer.num_speculative_tokens = configured_tokens
    proposer.max_tree_depth, proposer.max_spec_factor, proposer.min_token_prob = 24, 4.0, 0.0
    proposer.max_model_len = 1024
    proposer.suffix_cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=16)
    return proposer


def _propose(proposer, step_tokens: int):
    batch, sampled = drafting.two_rows()
    return proposer.propose(step_tokens, batch, sampled)


def test_a_step_with_fewer_drafts_than_configured_runs_only_with_the_patch():
    # Control: vLLM asserts that the step's K is the configured one.
    with pytest.raises(AssertionError):
        _propose(_proposer(8), 4)
    assert tail_drafting.apply() == "active"
    try:
        drafts = _propose(_proposer(8), 4)
        # The longest-running row gets the step's 4; the other ran 9 of 36 tokens: ceil(4 / 4) = 1.
        assert drafts == [[7, 8, 9, 10], [10]], drafts
        assert _propose(_proposer(8), 8)[0] == [7, 8, 9, 10, 11, 12, 7, 8]
        # A full-batch step drafts nothing, but the cache still learns the sampled tokens.
        proposer = _proposer(8)
        assert _propose(proposer, 0) == [[], []]
        assert set(proposer.suffix_cache.active_requests) == {"r0", "r1"}
        assert tail_drafting.COUNTERS.read() == {"steps": 3, "drafted_steps": 2, "draft_tokens": 4 + 1 + 8 + 2}
    finally:
        tail_drafting.revert()
    with pytest.raises(AssertionError):
        _propose(_proposer(8), 4)


def test_check_reports_a_drafting_run_that_drafted_nothing_as_not_bound():
    from rollout_ext.check import drafted_nothing
    from rollout_ext.testing.greedy import GreedyResult

    drafted = GreedyResult(tokens=[], logprobs=[], spec_decode={"drafts": 3, "draft_tokens": 5, "accepted_tokens": 1})
    idle = GreedyResult(tokens=[], logprobs=[], spec_decode={"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
    assert drafted_nothing(drafted, ["tail_drafting"]) == []
    assert drafted_nothing(idle, ["tail_drafting"]) == ["tail_drafting"]
    assert drafted_nothing(idle, ["rope_cache"]) == []  # not a drafting module: nothing to verify
