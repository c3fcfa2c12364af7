"""`rollout_ext check` counts a variant only where its modules bound in every process.

The lines come from the plugin's own `status_line`, so a change of its format that the parser
(`plugin.status_lines`) does not follow fails here."""

from rollout_ext.check import not_bound
from rollout_ext.plugin import ModuleState, status_line


def line(proc: str, **states: str) -> str:
    text = status_line({name: ModuleState(state=state, stack="vllm") for name, state in states.items()})
    return text.replace("MainProcess)", f"{proc})")


def log(*lines: str) -> str:
    return "\n".join(["INFO vLLM starting", *lines])


def test_bound_in_every_process():
    text = log(line("MainProcess", rope_cache="active", flashcomm="active"),
               line("VllmWorker-0", rope_cache="active", flashcomm="active"),
               line("VllmWorker-1", flashcomm="active", rope_cache="active", mc2="refused"))
    assert not_bound(text, ["rope_cache", "flashcomm"]) == []


def test_a_process_without_the_module_or_no_status_line_fails():
    # Controls: one worker lost a module; a run where the plugin never reported at all.
    text = log(line("VllmWorker-0", rope_cache="active", flashcomm="active"),
               line("VllmWorker-1", rope_cache="active", flashcomm="refused"))
    assert not_bound(text, ["rope_cache", "flashcomm"]) == ["flashcomm"]
    assert not_bound("INFO vLLM starting\n", ["mc2"]) == ["mc2"]
    assert not_bound(log(line("MainProcess", mc2="off")), ["mc2"]) == ["mc2"]
