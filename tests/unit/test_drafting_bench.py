"""bench/drafting_real.py's pure parts: the full-batch phase from finish times, the arms, bad flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import drafting_real  # noqa: E402


def test_the_full_batch_phase_ends_when_at_most_the_tail_limit_still_runs():
    finish = [5.0, 1.0, 2.0, 9.0, 3.0, 4.0]
    # 6 sequences, at most 2 may still run: the phase ends at the 4th finish.
    assert drafting_real.full_batch_s(finish, 2) == 4.0
    assert drafting_real.full_batch_s(finish, 0) == 9.0
    assert drafting_real.full_batch_s(finish, 6) == 0.0  # never above the limit: no full-batch phase


def test_the_noise_arm_runs_what_off_runs():
    assert drafting_real.ARMS["off_again"] == drafting_real.ARMS["off"] != drafting_real.ARMS["tail"]


def test_bad_flags_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        drafting_real.parse_args(["--repeats", "0"])
    assert "--repeats=0; allowed: >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        drafting_real.parse_args(["--prompts", "4"])
    assert "--prompts=4; allowed: at least 8" in capsys.readouterr().err
