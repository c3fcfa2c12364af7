"""bench/router_scale.py at a tiny size: every router serves chunked traffic and the JSON holds the numbers.

The bench runs in a subprocess (it starts its own local Ray, as tests/unit/test_router_protocol.py
does). 200 live requests on 4 replicas x 16 slots, so our tail_aware router parks the acquires that
find no free slot (the waiting regime) while verl's router and ours with verl_default never do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "router_scale.py"
ROUTERS = ("verl_default", "ours_verl_default", "ours_tail_aware")
PAIRS = 300


def _env() -> dict:
    from rollout_ext.config import environ_copy

    return {**environ_copy(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": str(REPO)}


def _bench(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("router_scale") / "result.json"
    done = _bench("--live", "200", "--replicas", "4", "--slots", "16", "--callers", "2", "--pairs", str(PAIRS),
                  "--routers", ",".join(ROUTERS), "--json", str(out), timeout_s=240)
    assert done.returncode == 0 and out.exists(), (done.stdout[-3000:], done.stderr[-3000:])
    return {"json": json.loads(out.read_text()), "stdout": done.stdout}


def test_every_router_served_the_traffic(report):
    routers = report["json"]["routers"]
    assert list(routers) == list(ROUTERS)
    for name in ROUTERS:
        run = routers[name]["runs"][0]
        assert not run.get("error"), (name, run)
        assert run["pairs"] >= PAIRS, (name, run["pairs"])
        assert run["pairs_per_s"] > 0 and run["requests_finished"] > 0, (name, run)
        assert run["caller_errors"] == 0 and run["callers_not_drained"] == 0, (name, run)
        for key in ("acquire_p50_ms", "acquire_p99_ms", "release_p50_ms", "release_p99_ms"):
            assert run[key] > 0, (name, key, run[key])
        assert run["acquire_p99_ms"] >= run["acquire_p50_ms"], (name, run)


def test_router_memory_and_cpu_are_reported(report):
    for name in ROUTERS:
        run = report["json"]["routers"][name]["runs"][0]
        assert run["rss_start_mib"] > 50 and run["rss_end_mib"] > 50, (name, run)  # a Ray worker with ray imported
        assert run["router_cpu_s"] > 0 and run["router_pid"] > 0, (name, run)
        summary = report["json"]["routers"][name]["summary"]
        assert summary["pairs_per_s"] == run["pairs_per_s"] and summary["repeats"] == 1


def test_the_callers_speak_each_routers_protocol(report):
    routers = report["json"]["routers"]
    # verl's router has no chunk answer: every request is cut into --chunk-tokens chunks.
    assert routers["verl_default"]["runs"][0]["rest_in_one_piece_share"] == 0.0
    # Ours with verl_default answers 0 (it never moves a sequence): the rest in one piece, one pair a request.
    assert routers["ours_verl_default"]["runs"][0]["rest_in_one_piece_share"] == 1.0
    assert routers["ours_verl_default"]["runs"][0]["first_acquire_share"] == 1.0


def test_tail_aware_parks_acquires_beyond_the_slots_and_the_callers_still_finish(report):
    routers = report["json"]["routers"]
    assert routers["ours_tail_aware"]["runs"][0]["mean_parked"] > 0
    assert routers["ours_tail_aware"]["summary"]["meets_target"].startswith("n/a")
    for name in ("verl_default", "ours_verl_default"):
        assert routers[name]["runs"][0]["mean_parked"] == 0


def test_json_records_versions_and_the_code_it_ran(report):
    setup = report["json"]["setup"]
    assert setup["ray"] and setup["verl"] and setup["python"]
    assert len(setup["git_head"]) == 40 and setup["router_sources_sha256"]
    assert report["json"]["args"]["live"] == 200
    assert "| ours_tail_aware |" in report["stdout"]


def test_in_process_mode_serves_the_same_traffic_without_ray(tmp_path):
    out = tmp_path / "local.json"
    done = _bench("--in-process", "--live", "200", "--replicas", "4", "--slots", "16", "--pairs", str(PAIRS),
                  "--routers", ",".join(ROUTERS), "--json", str(out), timeout_s=180)
    assert done.returncode == 0 and out.exists(), (done.stdout[-3000:], done.stderr[-3000:])
    assert "in process, no Ray" in done.stdout
    routers = json.loads(out.read_text())["routers"]
    for name in ROUTERS:
        run = routers[name]["runs"][0]
        assert not run.get("error") and run["caller_errors"] == 0, (name, run)
        assert run["pairs"] >= PAIRS and run["requests_finished"] > 0, (name, run)
    # 200 live on 4 x 16 slots: tail_aware parks the rest; the control, verl_default inside ours, never parks.
    assert routers["ours_tail_aware"]["runs"][0]["mean_parked"] > 50
    assert routers["ours_verl_default"]["runs"][0]["mean_parked"] == 0


@pytest.mark.parametrize("args, flag", [
    (["--in-process", "--profile-dir", "/tmp/x"], "--profile-dir"),
    (["--live", "0"], "--live"),
    (["--routers", "verl_default,nope"], "--routers"),
    (["--offered-pairs-per-s", "100", "--hold-ms", "5"], "--hold-ms"),
])
def test_bad_flag_names_itself(args, flag):
    done = _bench(*args, timeout_s=120)
    assert done.returncode != 0
    assert f"error: {flag}=" in done.stderr, done.stderr[-2000:]
