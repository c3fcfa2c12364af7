"""bench/balance_real.py without engines: arguments and the workload it sends (lengths stay hidden from the router)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.balance_real import FIRST_PROMPT_TOKEN, main, make_jobs, paired_ratios, parse_args, sampling_params  # noqa: E402


def test_defaults_fit_the_two_core_machine():
    a = parse_args([])
    assert (a.replicas, a.prompts, a.samples, a.min_len, a.cap, a.chunk_tokens) == (2, 16, 4, 16, 512, 64)
    assert a.policy_list == ["verl_default", "tail_aware"]
    assert a.workload == "arith" and a.model.endswith("arith-qwen2")  # natural lengths by default
    assert parse_args(["--workload", "forced"]).model.endswith("tiny-qwen2")
    with pytest.raises(SystemExit):
        parse_args(["--min-len", "600"])


def test_arith_jobs_sample_real_prompts_with_a_seed_each_and_no_length(arith_model, capsys):
    a = parse_args(["--prompts", "8", "--samples", "3", "--model", str(arith_model)])
    now, before = make_jobs(a, 0), make_jobs(a, -1)
    assert len(now) == 24 and len({j["request_id"] for j in now + before}) == 48
    assert len({j["seed"] for j in now + before}) == 48  # every sample its own random stream
    assert make_jobs(a, 0) == now  # and the same stream in every run: each policy decodes the same batch
    assert sorted({j["operands"] for j in now}) == list(range(1, 9))  # every operand count
    for p in range(8):
        group = now[3 * p: 3 * p + 3]
        assert all(j["prompt_ids"] == group[0]["prompt_ids"] for j in group)
        assert before[3 * p]["prompt_ids"] == group[0]["prompt_ids"]  # same prompt next epoch
    params = sampling_params(now[0], a.cap)
    assert params == {"temperature": 1.0, "seed": now[0]["seed"], "max_tokens": a.cap, "logprobs": True}
    # The control: a forced job carries its length to the engine.
    assert "extra_args" in sampling_params(make_jobs(parse_args(["--workload", "forced"]), 0)[0], a.cap)
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "7"])  # fewer prompts than operand counts
    assert "--prompts=7 with --workload arith" in capsys.readouterr().err


def test_jobs_are_group_correlated_and_stable_across_epochs():
    a = parse_args(["--workload", "forced", "--prompts", "6", "--samples", "3"])
    now, before = make_jobs(a, 0), make_jobs(a, -1)
    assert len(now) == 18 and len({j["request_id"] for j in now + before}) == 36
    assert all(a.min_len <= j["length"] <= a.cap for j in now)
    for p in range(6):
        group = now[3 * p: 3 * p + 3]
        assert all(j["prompt_ids"] == group[0]["prompt_ids"] for j in group)  # GRPO samples share a prompt
        assert before[3 * p]["prompt_ids"] == group[0]["prompt_ids"]  # same prompt next epoch
    assert min(min(j["prompt_ids"]) for j in now) >= FIRST_PROMPT_TOKEN  # never bos/eos/pad


def test_true_length_travels_only_in_extra_args():
    a = parse_args(["--workload", "forced"])
    job = make_jobs(a, 0)[0]
    params = sampling_params(job, a.cap)
    assert params["max_tokens"] == a.cap
    assert params["extra_args"]["eos_at_total"] == len(job["prompt_ids"]) + job["length"]


def test_paired_ratios_pair_repeats_not_medians():
    # A slow spell in repeat 2 slows both rows: paired, the row is 10% slower every time, with no spread.
    # Control: the same runs paired with the wrong repeats spread from 0.41 to 2.93.
    base = [4.0, 8.0, 3.0]
    row = [4.4, 8.8, 3.3]
    out = paired_ratios(row, base)
    assert out == {"paired_ratio_median": 1.1, "paired_ratio_range": [1.1, 1.1]}
    assert paired_ratios([4.4, 3.3, 8.8], base)["paired_ratio_range"] == [0.412, 2.933]
    with pytest.raises(ValueError):
        paired_ratios([1.0], base)  # every row has one run per repeat


def test_slow_replica_needs_a_second_replica_and_a_sane_delay():
    assert parse_args(["--slow-ms", "15"]).slow_ms == 15.0
    assert parse_args([]).slow_ms == 0.0
    for bad in (["--slow-ms", "-1"], ["--slow-ms", "nan"], ["--slow-ms", "15", "--replicas", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def _saved_run(tmp_path, policies):
    out = {"setup": {"replicas": 2, "prompts": 16, "samples": 4, "repeats": 3, "chunk_tokens": 64,
                     "slow_replica": {"address": "127.0.0.1:1", "step_ms": 15.0}},
           "results": [{"policy": name, "makespan_runs_s": runs} for name, runs in policies.items()]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(out))
    return path


def test_replot_draws_a_saved_run_without_engines(tmp_path):
    saved = _saved_run(tmp_path, {"verl_default": [10.0, 12.0, 11.0], "tail_aware": [6.0, 7.0, 8.0],
                                  "verl_default_unchunked": [10.5, 11.0, 12.0]})
    png = tmp_path / "run.png"
    main(["--replot", str(saved), "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(SystemExit):  # the ratios are over verl_default: a run without it cannot be drawn
        main(["--replot", str(_saved_run(tmp_path, {"tail_aware": [6.0]})), "--plot", str(png)])
    with pytest.raises(SystemExit):  # --replot alone would draw nowhere
        parse_args(["--replot", str(saved)])
