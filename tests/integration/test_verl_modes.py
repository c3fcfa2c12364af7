"""verl's asynchronous trainer modes with rollout.name=rollout_ext, end to end on CPU.

colocate_async (verl's v1 trainer: rollout runs ahead of training on the same replicas; at each
weight sync the unfinished samples are aborted and resumed after it, verl's partial rollout),
through examples/dapo_train_cpu.py as users run it: `verl.trainer.main_ppo`, real Ray, real verl,
real vLLM, the trained arithmetic model (its lengths vary, so samples are still running when a
batch is complete). 8 batches run ahead, for 3 steps. Which sync finds samples in flight depends on
timing: step 1 samples once enough groups pass DAPO's filter, and with an accurate model that may be
after everything already submitted has finished (then step 1 aborts nothing). The run-ahead window
then still holds finished groups, so a later step samples at once, while the batch that verl
submitted at the start of that step is still running, and that sync aborts it.

What the router must see there, from its own per-step summary (`rollout_ext/router_*`):
- every finished sequence with its length (verl's own resuming client reports none);
- the aborted chunks, each resumed under its sequence's record: no sequence becomes a second
  turn (verl's client makes every resume a new request of a finished one);
- an epoch closed per step.
The abort semantics against verl's own client (the control) and verl's rebalance_requests are
tested on real replicas in tests/integration/test_router_real.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def colocate_async(repo_root, engine_cache_env, tmp_path_factory):
    import subprocess

    from rollout_ext.config import environ_copy

    workdir = tmp_path_factory.mktemp("colocate_async")
    env = {**environ_copy(), **engine_cache_env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, str(repo_root / "examples" / "dapo_train_cpu.py"), "--task", "arith",
           "--trainer-mode", "colocate_async", "--ahead-batches", "8", "--steps", "3", "--val-prompts", "0",
           "--workdir", str(workdir), "--report", str(workdir / "report.json")]
    done = subprocess.run(cmd, env=env, cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads((workdir / "report.json").read_text())


def test_colocate_async_trains_three_steps(colocate_async):
    assert colocate_async["trainer_mode"] == "colocate_async"
    steps = colocate_async["steps"]
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert all(row["actor/grad_norm"] > 0 for row in steps), steps


def test_the_router_sees_every_length_and_resumes_aborted_sequences_in_place(colocate_async):
    routers = [row["router"] for row in colocate_async["steps"]]
    assert [r["epochs"] for r in routers] == [1, 2, 3]
    for r in routers:
        assert r["finished"] > 0 and r["lengths"] == r["finished"], r
        assert r["later_turns"] == 0, r  # a resume is never read as a new request
        # Chunks: at least one per finished sequence; 8-token chunks make many take more.
        assert r["acquires"] > r["finished"], r
    # Samples were still running at a weight sync: aborted, then resumed in place (the counts are
    # cumulative over the run).
    assert routers[-1]["aborts"] > 0, routers


def test_spec_estimate_reads_the_runs_rollout_dump(colocate_async, repo_root, tmp_path):
    """`python -m rollout_ext spec-estimate` on the dump verl wrote (trainer.rollout_data_dir): the
    trained model's responses, tokenized with its own tokenizer."""
    import subprocess

    dump = Path(colocate_async["rollout_dump"])
    assert sorted(p.name for p in dump.glob("*.jsonl")) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "rollout_ext", "spec-estimate", str(dump), "--tokenizer",
                           colocate_async["model"], "--json", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=repo_root, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "own+siblings+epochs" in done.stdout and "tokens per pass" in done.stdout
    result = json.loads(out.read_text())
    assert result["steps"] == [1, 2, 3] and result["responses"] == 3 * 4 * 4  # steps x prompts x n
    for row in result["rows"]:
        assert row["all_tokens_per_pass"] >= 1.0 and 0 < row["makespan_ratio_tail_drafting"] <= 1.0, row
    # Siblings and the same prompt's earlier responses are the draft source: they must add to own text.
    best = {(r["budget"], r["sources"]): r["all_tokens_per_pass"] for r in result["rows"]}
    assert best[(8, "own+siblings+epochs")] > best[(8, "own")], best
