"""The slow-steps test processor's control folder (rollout_ext/testing/slow_steps.py), without engines.
The processor itself runs inside real engines in tests/integration/test_router_real.py."""

from __future__ import annotations

import json

import pytest

from rollout_ext.testing.slow_steps import engine_under, engines, set_slow


def _register(folder, pid: int, ancestors: list[int]) -> None:
    (folder / f"engine-{pid}").write_text(json.dumps({"pid": pid, "ancestors": ancestors}))


def test_engines_are_listed_and_found_under_their_server(tmp_path):
    _register(tmp_path, 30, [20, 10, 1])
    _register(tmp_path, 31, [21, 11, 1])
    assert engines(tmp_path) == [30, 31]
    assert engine_under(tmp_path, 21) == 31 and engine_under(tmp_path, 10) == 30
    with pytest.raises(LookupError, match="0 engine"):
        engine_under(tmp_path, 99)
    with pytest.raises(LookupError, match="2 engine"):  # a process both descend from names no one engine
        engine_under(tmp_path, 1)


def test_set_slow_writes_replaces_and_clears(tmp_path):
    set_slow(tmp_path, {30: 15, 31: 2.5})
    assert float((tmp_path / "slow-30").read_text()) == 15.0
    set_slow(tmp_path, {31: 4})
    assert not (tmp_path / "slow-30").exists()  # an engine not named runs at its own speed again
    assert float((tmp_path / "slow-31").read_text()) == 4.0
    set_slow(tmp_path, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    set_slow(tmp_path, {31: 4})
    with pytest.raises(ValueError, match="ms for engine 30 is -1"):
        set_slow(tmp_path, {30: -1})
    assert float((tmp_path / "slow-31").read_text()) == 4.0  # a refused call changes nothing
    with pytest.raises(ValueError, match="nan"):
        set_slow(tmp_path, {30: float("nan")})
