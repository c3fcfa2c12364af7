"""DAPO training end to end on CPU: `verl.trainer.main_ppo` with rollout.name=rollout_ext, real Ray,
real verl 0.9.1, real vLLM, through examples/dapo_train_cpu.py as users run it (nothing mocked).

Two jobs, each in a subprocess with a hard timeout:
1. training: 2 steps must pass, with verl's own proof of the weight sync,
   `training/rollout_probs_diff_max` < 1e-4 at step 2, a finite non-zero `actor/grad_norm`, the
   router (TailAwareRouter) told about each step's end, the plugin loaded in every process of both
   replicas, and step 1's rollout traced on replica 0 by verl's rollout profiler;
2. control + fault: the same job with the weight sync between steps skipped, so step 2's
   rollout_probs_diff_max must exceed 0.1 (the check can fail); then a replica is killed during
   step 3, and the job must end non-zero within 60 s, name the phase, and leave no /dev/shm files.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

SHM = Path("/dev/shm")


def _env(engine_cache_env) -> dict[str, str]:
    from rollout_ext.config import environ_copy

    return {**environ_copy(), **engine_cache_env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _cmd(repo_root, tiny_qwen2, workdir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(repo_root / "examples" / "dapo_train_cpu.py"), "--model", str(tiny_qwen2),
            "--steps", str(steps), "--workdir", str(workdir), "--report", str(workdir / "report.json"), *extra]


def _shm() -> set[str]:
    return {p.name for p in SHM.glob("verl_weights_*")}


@pytest.fixture(scope="module")
def trained(repo_root, tiny_qwen2, engine_cache_env, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("train")
    before = _shm()
    cmd = _cmd(repo_root, tiny_qwen2, workdir, 2, "--profile-rollout", str(workdir / "traces"))
    proc = subprocess.run(cmd, env=_env(engine_cache_env), cwd=repo_root, capture_output=True, text=True,
                          timeout=900)
    return proc, json.loads((workdir / "report.json").read_text()), _shm() - before


def test_two_steps_train_and_sync_weights(trained):
    proc, report, leftover = trained
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    steps = report["steps"]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0, row
        assert row["kept_groups"] > 0
        for name in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights"):
            assert row[name] is not None and row[name] > 0, (name, row)
    assert steps[1]["training/rollout_probs_diff_max"] < 1e-4, steps
    # Cross-epoch history: verl itself closed the router's epoch after each step.
    assert [row["router"]["epochs"] for row in steps] == [1, 2]
    assert steps[1]["router"]["finished"] > steps[0]["router"]["finished"] > 0
    assert report["router_class"] == "rollout_ext.verl.router.TailAwareRouter"
    assert report["router_policy"] == "tail_aware"
    assert not leftover


def test_plugin_loaded_in_every_replica_process(trained):
    _, report, _ = trained
    lines = report["plugin_lines"]
    processes = [re.search(r"\(pid (\d+), ([^)]+)\)", line).groups() for line in lines]
    assert len({pid for pid, _ in processes}) == len(lines) == 6, lines  # 2 replicas x 3 processes
    assert sorted(name for _, name in processes) == ["EngineCore"] * 2 + ["MainProcess"] * 2 + ["VllmWorker-0"] * 2
    assert all("device=cpu" in line and "active=[rope_cache]" in line for line in lines)


def test_rollout_phase_trace_appears_and_loads(trained):
    _, report, _ = trained
    traces = [Path(p) for p in report["rollout_traces"] if ".pt.trace.json" in p]
    assert traces, report["rollout_traces"]
    # verl's layout: one directory per profiled replica; rank 0 (replica 0) only by default
    assert {p.parent.name for p in traces} == {"agent_loop_rollout_replica_0"}
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        assert json.load(f)["traceEvents"], "empty trace"


def test_phase_lines_and_summaries_are_printed(trained):
    proc, _, _ = trained
    for phase in ("gen", "old_log_prob", "update_actor", "update_weights"):
        assert f"[step 2] {phase} ..." in proc.stdout
    assert "step 2: reward " in proc.stdout and "probs_diff_max" in proc.stdout


def _example(repo_root):
    """examples/dapo_train_cpu.py as a module, for its process helpers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dapo_train_cpu", repo_root / "examples" / "dapo_train_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_control_without_sync_fails_the_check_and_a_killed_replica_ends_the_job(
        repo_root, tiny_qwen2, engine_cache_env, tmp_path):
    before = _shm()
    cmd = _cmd(repo_root, tiny_qwen2, tmp_path, 3, "--control-no-sync")
    proc = subprocess.Popen(cmd, env=_env(engine_cache_env), cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output, killed_at = [], None
    deadline = time.monotonic() + 900
    for line in proc.stdout:
        output.append(line)
        if killed_at is None and line.startswith("[step 3] gen"):
            # A replica server of this run only: the example's own process-tree walk.
            victims = [pid for pid, cmd in _example(repo_root).descendants(proc.pid).items()
                       if cmd.startswith("ray::RolloutExtHttpServer")]
            assert victims, "no replica server process found"
            os.kill(victims[0], signal.SIGKILL)
            killed_at = time.monotonic()
        assert time.monotonic() < deadline, "".join(output[-50:])
    rc = proc.wait(timeout=120)
    ended_at = time.monotonic()
    text = "".join(output)
    assert killed_at is not None, text[-3000:]
    assert rc != 0 and ended_at - killed_at < 60, (rc, ended_at - killed_at, text[-3000:])
    assert "FAILED in step 3, phase gen" in text and "died" in text, text[-3000:]
    assert not (_shm() - before)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_step"] == 3 and report["failed_phase"] == "gen"
    steps = {row["step"]: row for row in report["steps"]}
    # The control: replicas kept step 1's weights, so step 2's rollout disagrees with the actor.
    assert steps[2]["training/rollout_probs_diff_max"] > 0.1, steps
    assert "rollout_ext control: weight sync skipped" in (tmp_path / "main_ppo.log").read_text()
