"""The plugin inside real vLLM on CPU: loaded in every process, and output unchanged."""

from __future__ import annotations

import pytest

from rollout_ext.plugin import status_lines
from rollout_ext.testing.equivalence import OFF_ENV, assert_equivalent, module_env

pytestmark = pytest.mark.heavy

VANILLA = {"VLLM_PLUGINS": ""}


def plugin_lines(log: str) -> list[dict]:
    """The plugin's status lines (the modules that bound, then the process) of this version on CPU."""
    return [line for line in status_lines(log) if line["version"] == "0.1.0" and line["device"] == "cpu"]


def test_tp2_eager_plugin_in_every_process_and_output_unchanged(greedy_run):
    # The deployed layout: EngineCore in its own process, as verl's servers and `vllm serve` run it.
    with_plugin = greedy_run("qwen2", 2, True, OFF_ENV, in_process=False)
    lines = plugin_lines(with_plugin.log)
    processes = {line["proc"] for line in lines}
    assert {"MainProcess", "EngineCore", "VllmWorker-0", "VllmWorker-1"} <= processes, lines
    # One line per process: the plugin is idempotent however often vLLM loads it.
    pids = [line["pid"] for line in lines]
    assert len(pids) == len(set(pids))
    # Without the plugin, and in the in-process layout that every module's equivalence test uses:
    # neither the plugin nor the process layout changes a token or a log-prob.
    without = greedy_run("qwen2", 2, True, VANILLA)
    assert plugin_lines(without.log) == []
    assert_equivalent(with_plugin, without, atol=0.0)


def test_tp1_compiled_default_modules_output_unchanged(greedy_run):
    defaults = greedy_run("qwen2", 1, False, module_env(rope_cache="1"))
    lines = plugin_lines(defaults.log)
    assert [line["proc"] for line in lines] == ["MainProcess"]  # EngineCore and worker run in it
    assert all(line["active"] == ["rope_cache"] for line in lines)
    without = greedy_run("qwen2", 1, False, VANILLA)
    assert_equivalent(defaults, without, atol=1e-4)
