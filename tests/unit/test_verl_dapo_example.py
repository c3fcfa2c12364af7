"""The CPU training example's own pieces, without an engine: the toy reward, the report line, the
argument checks, the /dev/shm clean-up, and the supervisor's verdict on a child that passes or fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from pathlib import Path

import pytest


def _load(repo_root, name):
    spec = importlib.util.spec_from_file_location(name, repo_root / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example(repo_root):
    yield _load(repo_root, "dapo_train_cpu")
    sys.modules.pop("dapo_train_cpu", None)


def test_vowel_reward_varies_and_is_bounded(repo_root):
    reward = _load(repo_root, "vowel_reward")
    assert reward.compute_score("toy", "aeiou")["score"] == 1.0
    assert reward.compute_score("toy", "xyz")["score"] == 0.0
    assert reward.compute_score("toy", "")["score"] == 0.0
    assert reward.compute_score("toy", "banana")["score"] == pytest.approx(0.5)
    assert reward.compute_score("toy", "Ab 12 !")["acc"] == pytest.approx(0.5)  # letters only, any case


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps=0 is not allowed; use an integer >= 1"),
    (["--lr", "-1"], "--lr=-1.0 is not allowed; use a number >= 0"),
    (["--overlong-buffer", "300"], "--overlong-buffer=300 is not allowed; use 1..--response-length (256)"),
    (["--task", "chess"], "--task: invalid choice: 'chess'"),
])
def test_bad_arguments_name_the_flag(repo_root, args, message):
    proc = subprocess.run([sys.executable, str(repo_root / "examples" / "dapo_train_cpu.py"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_arith_dataset_carries_the_answer_and_the_reward_reads_it(tmp_path):
    import pandas as pd

    from rollout_ext.testing import arith
    from rollout_ext.verl.tiny_run import write_arith_parquet

    frame = pd.read_parquet(write_arith_parquet(tmp_path / "train.parquet", 16, seed=3))
    assert len(frame) == 16 and set(frame["data_source"]) == {"arith"}
    row = frame.iloc[0]
    problem = arith.problems(3, 1)[0]
    assert row["prompt"][0]["content"] == problem.prompt
    truth = row["reward_model"]["ground_truth"]
    assert arith.compute_acc("arith", f"... A:{problem.answer}", truth) == {"score": 1.0, "acc": 1.0}
    assert arith.compute_acc("arith", f"... A:{problem.answer + 1}", truth)["score"] == 0.0  # control


def test_summary_line_reads_verl_metric_names(example):
    row = {"step": 2, "critic/score/mean": -0.6, "training/rollout_probs_diff_max": 4e-6, "actor/grad_norm": 6.0,
           "timing_s/gen": 2.0, "timing_s/update_actor": 0.3, "timing_s/update_weights": 0.1,
           "response_length/mean": 41.25, "router": {"moves": 0}}
    line = example.summary_line(row)
    assert line.startswith("step 2: reward -0.6  length 41.2  probs_diff_max 4e-06  grad_norm 6")
    assert "router moves 0" in line
    assert "reward -" in example.summary_line({"step": 1, "router": {}})  # missing metrics print as "-"


def test_only_unmapped_shm_files_are_removed(example):
    ours = Path("/dev/shm") / f"psm_test{uuid.uuid4().hex[:8]}"
    held = Path("/dev/shm") / f"psm_test{uuid.uuid4().hex[:8]}"
    ours.write_bytes(b"x" * 4096)
    held.write_bytes(b"x" * 4096)
    import mmap

    with open(held, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live process maps it
        removed = example.remove_orphans({ours.name, held.name})
        assert removed == 1 and not ours.exists() and held.exists()
    held.unlink()


def _supervised(example, tmp_path, script: str, steps: int = 2):
    """Run `script` as the example runs main_ppo (own process group, a reader thread) and supervise it."""
    import argparse
    import threading
    import time

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    watch = example.Watch()
    with open(tmp_path / "child.log", "w") as log:
        reader = threading.Thread(target=watch.read, args=(proc.stdout, log), daemon=True)
        reader.start()
        try:
            failure = example.supervise(proc, watch, argparse.Namespace(steps=steps, timeout_s=60), time.monotonic())
        finally:
            if proc.poll() is None:
                example.kill_group(proc)
            reader.join(timeout=10)
    return failure, watch, proc


STEPS = ("import time\n"
         "for _ in range(2):\n"
         "    for line in ('step start', 'gen start', 'gen end', 'step end'):\n"
         "        print('rollout_ext phase:', line, flush=True)\n")


def test_clean_exit_after_the_last_step_is_a_pass(example, tmp_path):
    failure, watch, proc = _supervised(example, tmp_path, STEPS)
    assert failure is None and proc.returncode == 0
    assert watch.steps_done == 2 and watch.phase == "gen"


def test_nonzero_exit_and_reported_errors_fail_naming_the_cause(example, tmp_path):
    # control for the test above: the same child, exiting 3
    failure, _, _ = _supervised(example, tmp_path, STEPS + "raise SystemExit(3)\n")
    assert failure == "main_ppo exited 3"
    failure, watch, proc = _supervised(
        example, tmp_path, "print('Traceback (most recent call last):', flush=True)\nimport time; time.sleep(60)\n")
    assert failure.startswith("error reported: Traceback") and proc.returncode != 0  # the group was killed


def test_verl_loads_the_arith_reward_file_by_path(repo_root):
    from verl.utils.import_utils import load_extern_object

    compute_acc = load_extern_object(module_path=str(repo_root / "examples" / "arith_reward.py"),
                                     object_name="compute_acc")
    assert compute_acc("arith", "12+3=15. A:15", "15") == {"score": 1.0, "acc": 1.0}
    # Control: the module itself cannot be loaded by path (its dataclass needs sys.modules).
    with pytest.raises(RuntimeError, match="Error loading module"):
        load_extern_object(module_path=str(repo_root / "rollout_ext" / "testing" / "arith.py"),
                           object_name="compute_acc")


def test_the_held_out_set_is_sampled_only_when_asked(example):
    import argparse

    off = argparse.Namespace(val_prompts=0, val_n=4, task="arith")
    assert example.validation_overrides(off) == ["trainer.val_before_train=False", "trainer.test_freq=-1"]
    assert example.val_metric(off) is None
    on = argparse.Namespace(val_prompts=64, val_n=4, task="arith")
    assert "trainer.test_freq=1" in example.validation_overrides(on)
    assert "actor_rollout_ref.rollout.val_kwargs.temperature=1.0" in example.validation_overrides(on)
    # verl's name for the core validation metric of data source "arith" with n=4 samples.
    assert example.val_metric(on) == "val-core/arith/acc/mean@4"
