"""verl with rollout.name=rollout_ext on CPU: real Ray, real verl 0.9.1, real vLLM; nothing mocked.

One run of the CPU DAPO example (examples/dapo_tiny_cpu.py, the rollout fallback) is shared by the
module: it starts one local Ray cluster and one set of two replicas, runs verl's agent loop, and
writes a report the tests read. It runs in a subprocess so Ray can be pinned to 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before ray is imported).
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def dapo_report(repo_root, python_exe, tiny_qwen2, engine_cache_env, tmp_path_factory):
    from rollout_ext.config import environ_copy

    report = tmp_path_factory.mktemp("dapo") / "report.json"
    env = {
        **environ_copy(),
        **engine_cache_env,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [
        python_exe, str(repo_root / "examples" / "dapo_tiny_cpu.py"),
        "--model", str(tiny_qwen2), "--data-dir", str(report.parent / "data"),
        "--iterations", "2", "--prompts-per-step", "2", "--n", "4",
        "--response-length", "16", "--overlong-buffer", "4", "--max-gen-batches", "2",
        "--report", str(report), "--profile-rollout", str(report.parent / "traces"),
    ]
    done = subprocess.run(cmd, env=env, cwd=repo_root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    return json.loads(report.read_text())


def test_two_replicas_start_with_the_plugin_in_every_process(dapo_report):
    assert dapo_report["replica_classes"] == ["RolloutExtReplica"]
    assert all(address.startswith("127.0.0.1:") for address in dapo_report["server_addresses"])
    lines = dapo_report["plugin_lines"]
    assert len(lines) == 2
    pids = set()
    for replica_lines in lines:
        processes = {re.search(r"\(pid (\d+), ([^)]+)\)", line).group(2) for line in replica_lines}
        pids |= {re.search(r"\(pid (\d+),", line).group(1) for line in replica_lines}
        # the server actor (vLLM's API side), its engine core and its worker all loaded the plugin
        assert "MainProcess" in processes and "EngineCore" in processes, replica_lines
        assert any(name.startswith("VllmWorker") for name in processes), replica_lines
        assert all("device=cpu" in line and "active=[rope_cache]" in line for line in replica_lines)
    assert len(pids) >= 6  # two replicas, three processes each, none shared


def test_agent_loop_returns_tokens_and_log_probs_for_every_sample(dapo_report):
    checks = [check for it in dapo_report["iterations"] for check in it["checks"]]
    assert len(checks) >= 2 * 2 * 4
    assert all(check["response_tokens"] > 0 for check in checks)
    assert all(check["log_probs_finite"] for check in checks)


def test_dapo_rollout_fallback_completes_two_iterations(dapo_report):
    iterations = dapo_report["iterations"]
    assert [it["step"] for it in iterations] == [1, 2]
    for it in iterations:
        assert 1 <= it["rollout/gen_batches"] <= 2
        assert it["rollout/samples"] == it["rollout/gen_batches"] * 2 * 4
        assert it["timing_s/rollout"] > 0 and it["rollout/response_tokens"] > 0
        # filter_groups: kept groups only ever come from groups whose acc varies
        assert 0 <= it["filter_groups/kept_groups"] <= 2
        # a full batch stops drawing; an empty one draws up to max_gen_batches
        assert it["filter_groups/kept_groups"] == 2 or it["rollout/gen_batches"] == 2


def test_rollout_phase_trace_appears_and_loads(dapo_report):
    traces = [Path(p) for p in dapo_report["rollout_traces"] if ".pt.trace.json" in p]
    assert traces, dapo_report["rollout_traces"]
    # verl's layout: one directory per profiled replica; rank 0 (replica 0) only by default
    assert {p.parent.name for p in traces} == {"agent_loop_rollout_replica_0"}
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        trace = json.load(f)
    assert trace["traceEvents"], "empty trace"
