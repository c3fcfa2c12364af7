"""`rollout_ext check` counts a variant only where its modules bound in every process."""

from rollout_ext.check import not_bound

LINE = "rollout_ext 0.1.0: device=cpu vllm=0.27.1 active=[{}]{} (pid {}, {})"


def log(*lines: tuple[str, str]) -> str:
    return "\n".join(["INFO vLLM starting"] + [LINE.format(mods, extra, 100 + i, proc)
                                               for i, (mods, proc, extra) in enumerate(lines)])


def test_bound_in_every_process():
    text = log(("rope_cache,flashcomm", "MainProcess", ""), ("rope_cache,flashcomm", "VllmWorker-0", ""),
               ("flashcomm,rope_cache", "VllmWorker-1", " refused=[mc2]"))
    assert not_bound(text, ["rope_cache", "flashcomm"]) == []


def test_a_process_without_the_module_or_no_status_line_fails():
    # Controls: one worker lost a module; a run where the plugin never reported at all.
    text = log(("rope_cache,flashcomm", "VllmWorker-0", ""), ("rope_cache", "VllmWorker-1", " refused=[flashcomm]"))
    assert not_bound(text, ["rope_cache", "flashcomm"]) == ["flashcomm"]
    assert not_bound("INFO vLLM starting\n", ["mc2"]) == ["mc2"]
    assert not_bound(log(("", "MainProcess", "")), ["mc2"]) == ["mc2"]
