"""DAPO training end to end on CPU: `verl.trainer.main_ppo` with rollout.name=rollout_ext, real Ray,
real verl 0.9.1, real vLLM, through examples/dapo_train_cpu.py as users run it (nothing mocked).

One job, in a subprocess with a hard timeout (each verl/Ray start costs ~150 s on 2 cores, so the
pass, the control and the fault share it):
1. steps 1-2 must pass, with tail drafting on in the replicas (suffix drafting while few sequences
   run: it must stay lossless), with verl's own proof of the weight sync,
   `training/rollout_probs_diff_max` < 1e-4 at steps 1 and 2, drafts verified, a finite non-zero `actor/grad_norm`, the
   router (TailAwareRouter) told about each step's end, the plugin loaded in every process of both
   replicas, and step 1's rollout traced on replica 0 by verl's rollout profiler;
2. control: the sync after step 2 is skipped (tests/support/skip_weight_sync.py), so step 3's
   rollout runs on step 1's weights and its rollout_probs_diff_max must exceed 0.1 (the check
   can fail);
3. fault: a replica is killed during step 4's rollout, and the job must end non-zero within 60 s,
   name the step and phase, and leave no /dev/shm files.
The example's clean-exit path (rc 0 after the last step) is tested without Ray in
tests/unit/test_verl_dapo_example.py.
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
            "--task", "vowel", "--steps", str(steps), "--workdir", str(workdir), "--report", str(workdir / "report.json"), *extra]


def _shm() -> set[str]:
    return {p.name for p in SHM.glob("verl_weights_*")}


def _example(repo_root):
    """examples/dapo_train_cpu.py as a module, for its process helpers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dapo_train_cpu", repo_root / "examples" / "dapo_train_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KILL_IN_STEP = 4


@pytest.fixture(scope="module")
def trained(repo_root, tiny_qwen2, engine_cache_env, tmp_path_factory):
    """The job, with a replica server of this run killed when step 4's rollout starts."""
    workdir = tmp_path_factory.mktemp("train")
    before = _shm()
    cmd = _cmd(repo_root, tiny_qwen2, workdir, KILL_IN_STEP, "--control-no-sync", "--tail-drafting",
               "--profile-rollout", str(workdir / "traces"))
    proc = subprocess.Popen(cmd, env=_env(engine_cache_env), cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output, killed_at = [], None
    deadline = time.monotonic() + 900
    for line in proc.stdout:
        output.append(line)
        if killed_at is None and line.startswith(f"[step {KILL_IN_STEP}] gen"):
            # The example's own process-tree walk: a replica of this run only, not a machine-wide scan.
            victims = [pid for pid, cmd in _example(repo_root).descendants(proc.pid).items()
                       if cmd.startswith("ray::RolloutExtHttpServer")]
            assert victims, "no replica server process found"
            os.kill(victims[0], signal.SIGKILL)
            killed_at = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("training job ran past 900 s:\n" + "".join(output[-50:]))
    rc = proc.wait(timeout=120)
    report_path = workdir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {"rc": rc, "text": "".join(output), "killed_at": killed_at, "ended_at": time.monotonic(),
            "report": report, "leftover": _shm() - before, "workdir": workdir}


def _steps(job) -> dict[int, dict]:
    assert job["report"], job["text"][-3000:]
    return {row["step"]: row for row in job["report"]["steps"]}


def test_two_steps_train_and_sync_weights(trained):
    steps = _steps(trained)
    assert sorted(steps) == [1, 2, 3], (sorted(steps), trained["text"][-3000:])
    for row in steps.values():
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0, row
        assert row["kept_groups"] > 0
        for name in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor"):
            assert row[name] is not None and row[name] > 0, (name, row)
    assert steps[1]["timing_s/update_weights"] > 0, steps[1]
    assert steps[1]["training/rollout_probs_diff_max"] < 1e-4 and steps[2]["training/rollout_probs_diff_max"] < 1e-4, steps
    # Drafting ran in the replicas (vLLM's own counters, from its log), and stayed lossless above.
    assert trained["report"]["spec_decode"]["draft_tokens"] > 0, trained["report"]["spec_decode"]
    # Cross-epoch history: verl itself closed the router's epoch after each step.
    assert [steps[i]["router"]["epochs"] for i in (1, 2, 3)] == [1, 2, 3]
    assert steps[2]["router"]["finished"] > steps[1]["router"]["finished"] > 0
    # Every sequence's length reached the router (the predictor's history), none as a second turn.
    assert all(steps[i]["router"]["lengths"] == steps[i]["router"]["finished"] for i in (1, 2, 3)), steps
    assert all(steps[i]["router"]["later_turns"] == 0 for i in (1, 2, 3))
    assert trained["report"]["router_class"] == "rollout_ext.verl.router.TailAwareRouterActor"
    assert trained["report"]["router_policy"] == "tail_aware"


def test_control_without_sync_fails_the_check(trained):
    steps = _steps(trained)
    # The replicas kept step 1's weights while the actor took step 2's update.
    assert steps[3]["training/rollout_probs_diff_max"] > 0.1, steps
    log = (trained["workdir"] / "main_ppo.log").read_text()
    assert "rollout_ext control: weight sync skipped after step 2" in log
    assert "weight sync skipped after step 1" not in log


def test_killed_replica_ends_the_job_fast_and_cleanly(trained):
    text = trained["text"]
    assert trained["killed_at"] is not None, text[-3000:]
    assert trained["rc"] != 0 and trained["ended_at"] - trained["killed_at"] < 60, (
        trained["rc"], trained["ended_at"] - trained["killed_at"], text[-3000:])
    assert f"FAILED in step {KILL_IN_STEP}, phase gen" in text and "died" in text, text[-3000:]
    assert trained["report"]["failed_step"] == KILL_IN_STEP and trained["report"]["failed_phase"] == "gen"
    assert not trained["leftover"]


def test_plugin_loaded_in_every_replica_process(trained):
    lines = trained["report"]["plugin_lines"]
    processes = [re.search(r"\(pid (\d+), ([^)]+)\)", line).groups() for line in lines]
    assert len({pid for pid, _ in processes}) == len(lines) == 6, lines  # 2 replicas x 3 processes
    assert sorted(name for _, name in processes) == ["EngineCore"] * 2 + ["MainProcess"] * 2 + ["VllmWorker-0"] * 2
    assert all("device=cpu" in line and "active=[rope_cache,tail_drafting]" in line for line in lines)


def test_rollout_phase_trace_appears_and_loads(trained):
    traces = [Path(p) for p in trained["report"]["rollout_traces"] if ".pt.trace.json" in p]
    assert traces, trained["report"]["rollout_traces"]
    # verl's layout: one directory per profiled replica; rank 0 (replica 0) only by default
    assert {p.parent.name for p in traces} == {"agent_loop_rollout_replica_0"}
    opener = gzip.open if traces[0].suffix == ".gz" else open
    with opener(traces[0], "rt") as f:
        assert json.load(f)["traceEvents"], "empty trace"


def test_phase_lines_and_summaries_are_printed(trained):
    for phase in ("gen", "old_log_prob", "update_actor"):
        assert f"[step 2] {phase} ..." in trained["text"]
    assert "[step 1] update_weights ..." in trained["text"]  # the control skips the later syncs
    assert "step 2: reward " in trained["text"] and "probs_diff_max" in trained["text"]
