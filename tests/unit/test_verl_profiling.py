"""Phase-separated profiling: presets resolve through verl's own config, and phase traces load."""

from __future__ import annotations

import gzip
import json

import pytest

from rollout_ext.verl.profiling import phase_overrides, phase_trace, profiler_tool, rollout_only_preset


def test_rollout_only_preset_resolves_in_verls_config(tmp_path):
    from verl.utils.config import omega_conf_to_dataclass

    from rollout_ext.verl.tiny_run import compose

    preset = rollout_only_preset(tmp_path, max_response_length=64)
    cfg = compose(["actor_rollout_ref.rollout.name=rollout_ext", *preset])
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.profiler)
    actor = cfg.actor_rollout_ref.actor.profiler
    assert rollout.enable and rollout.tool == profiler_tool() == "torch"
    assert list(rollout.ranks) == [0] and not rollout.all_ranks
    assert rollout.tool_config["torch"]["discrete"] is True
    assert not actor.enable
    assert cfg.data.max_response_length == 64 and not cfg.trainer.val_before_train
    assert not cfg.algorithm.filter_groups.enable
    assert not cfg.reward.reward_kwargs.overlong_buffer_cfg.enable


def test_actor_phase_leaves_the_rollout_off(tmp_path):
    overrides = phase_overrides("actor", tmp_path, ranks=(0, 8))
    assert "actor_rollout_ref.actor.profiler.ranks=[0,8]" in overrides
    assert "actor_rollout_ref.rollout.profiler.enable=False" in overrides
    with pytest.raises(ValueError):
        phase_overrides("critic", tmp_path)


def test_phase_trace_writes_a_loadable_trace_on_rank_0_only(tmp_path):
    import torch

    with phase_trace("rollout", tmp_path, rank=0):
        torch.ones(64, 64) @ torch.ones(64, 64)
    with phase_trace("rollout", tmp_path / "other", rank=1):
        torch.ones(8)
    traces = list((tmp_path / "rollout").glob("rollout_rank0*.pt.trace.json*"))
    assert len(traces) == 1 and not (tmp_path / "other").exists()
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any("mm" in str(event.get("name", "")) for event in events)
