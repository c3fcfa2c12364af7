"""Thousands of requests waiting for a slot, in a router started as verl starts it (real Ray).

One replica with 100 slots and 5,200 requests acquired at once: 5,100 wait in the router while the placed
ones are released. Every request must be served, and get_status must answer promptly while they wait.

Control: the same router class started as verl starts a plain class, `ray.remote(TailAwareRouter)`, with
Ray's default of 1,000 concurrent calls for an async actor. With 1,200 requests, the parked acquires take
every call slot, and the releases that would free a replica slot queue behind them: nothing more is served.

Ray runs in a subprocess pinned to this machine; it prints one JSON report per scenario.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLOTS = 100
WAITING = 5_000


async def _drive(lb, requests: int, timeout_s: float) -> dict:
    import asyncio
    import time

    served = 0

    async def one(i: int) -> None:
        nonlocal served
        rid = f"q{i}"
        sid, _ = await lb.acquire_server.remote(request_id=rid, prompt_ids=[i % 97, 1, 2],
                                                sampling_params={"max_tokens": 64})
        await lb.release_server.remote(server_id=sid, request_id=rid, generated_tokens=5, finished=True)
        served += 1

    work = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(requests))))
    started = time.perf_counter()
    # The status call's latency counts once the burst of acquires is in (the first one queues behind them).
    max_waiting, status_s, status_timeouts = 0, [], 0
    while not work.done() and time.perf_counter() - started < timeout_s:
        t0 = time.perf_counter()
        try:
            status = await asyncio.wait_for(asyncio.wrap_future(lb.get_status.remote().future()), 5.0)
            if max_waiting >= WAITING:
                status_s.append(time.perf_counter() - t0)
            max_waiting = max(max_waiting, status["waiting"])
        except asyncio.TimeoutError:
            status_timeouts += 1
        await asyncio.wait([work], timeout=0.2)
    finished = work.done()
    if not finished:
        work.cancel()
    return {"requests": requests, "served": served, "all_served": finished and served == requests,
            "max_waiting": max_waiting, "status_s_while_waiting": status_s, "status_timeouts": status_timeouts,
            "wall_s": time.perf_counter() - started}


def main(scenario: str, tmp: str) -> None:
    import asyncio

    import ray
    from verl.workers.rollout.router import get_router_handle

    from rollout_ext.verl.router import TailAwareRouter

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Server:
        def name(self) -> str:
            return "server"

    config = {"policy": "tail_aware", "slots_per_replica": SLOTS, "chunk_tokens": 0}
    servers = {"s0": Server.remote()}
    try:
        if scenario == "shipped":
            path = Path(tmp) / "router.yaml"
            path.write_text("router_class: rollout_ext.verl.router.TailAwareRouterActor\n"
                            + "".join(f"{k}: {v}\n" for k, v in config.items()))
            lb = get_router_handle(servers, router_config_path=str(path))
            report = asyncio.run(_drive(lb, 5_200, timeout_s=240))
        else:  # how verl starts a class that is not already a Ray actor class
            lb = ray.remote(TailAwareRouter).remote(servers, config)
            report = asyncio.run(_drive(lb, 1_200, timeout_s=25))
        print("REPORT" + json.dumps(report))
    finally:
        ray.shutdown()


def _run(scenario: str, tmp: Path) -> dict:
    from rollout_ext.config import environ_copy

    env = {**environ_copy(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, scenario, str(tmp)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=420)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, (done.stdout[-3000:], done.stderr[-5000:])
    return json.loads(lines[-1][len("REPORT"):])


def test_five_thousand_waiting_requests_are_all_served(tmp_path):
    report = _run("shipped", tmp_path)
    assert report["all_served"], report
    assert report["max_waiting"] >= WAITING, report  # they really waited in the router at once
    # While thousands wait, a status call is answered at once (releases are, or nothing would be served).
    assert report["status_timeouts"] == 0 and report["status_s_while_waiting"], report
    assert max(report["status_s_while_waiting"]) < 1.0, report


def test_control_the_plain_class_stalls_past_a_thousand_waiting(tmp_path):
    report = _run("plain", tmp_path)
    assert not report["all_served"] and report["served"] <= SLOTS, report
    assert report["status_timeouts"] >= 1, report  # even get_status queues behind the parked acquires


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
