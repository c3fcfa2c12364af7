"""TailAwareRouter under verl's RequestLoadBalancer protocol, in a real Ray actor started by verl's loader.

The servers are plain Ray actors defined here (they only need to be handles); the router is built by
verl's own `get_router_handle(servers, router_config_path=...)`, so the YAML loading, `ray.remote`
wrapping and constructor call are verl's. Ray runs in a subprocess pinned to 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before ray is imported); it prints one JSON report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _scenarios(tmp: Path) -> dict:
    import asyncio

    import ray
    from verl.workers.rollout.router import RequestLoadBalancer, get_router_handle

    from rollout_ext.verl.router import TailAwareRouter

    @ray.remote(num_cpus=0)
    class Server:
        def name(self) -> str:
            return "server"

    @ray.remote(num_cpus=0)
    class GatedServer:
        """A server with the submission gate our replica servers expose (closed between abort and resume)."""

        def __init__(self):
            self.open = True

        def set_open(self, value: bool) -> None:
            self.open = value

        def submission_open(self) -> bool:
            return self.open

    out: dict = {}
    protocol = {n for n in dir(RequestLoadBalancer) if not n.startswith("_")}
    out["missing_methods"] = sorted(protocol - set(dir(TailAwareRouter)))

    def router(policy: str, slots: int):
        path = tmp / f"{policy}-{slots}.yaml"
        path.write_text(f"router_class: rollout_ext.verl.router.TailAwareRouterActor\npolicy: {policy}\n"
                        f"slots_per_replica: {slots}\nchunk_tokens: 8\n")
        servers = {f"s{i}": Server.remote() for i in range(2)}
        return get_router_handle(servers, router_config_path=str(path))

    async def run() -> None:
        # verl_default: least in-flight, sticky continuations, release bookkeeping.
        lb = router("verl_default", 4)
        out["fields"] = [await lb.require_acquire_fields.remote(), await lb.require_release_fields.remote()]
        out["chunk_tokens"] = await lb.chunk_tokens.remote()
        a, _ = await lb.acquire_server.remote(request_id="a", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 16})
        out["first_replica_a"] = a
        b, _ = await lb.acquire_server.remote(request_id="b", prompt_ids=[4, 5], sampling_params={"max_tokens": 16})
        out["spread"] = a != b
        await lb.release_server.remote(server_id=a, request_id="a", generated_tokens=8, finished=False)
        again, handle = await lb.acquire_server.remote(request_id="a", prompt_ids=[1, 2, 3] + [0] * 8,
                                                        sampling_params={"max_tokens": 16})
        out["sticky"] = again == a
        out["handle_works"] = await handle.name.remote() == "server"
        out["inflight_2"] = await lb.get_total_inflight.remote()
        # A release queued behind the next acquire: the acquire releases first, the late release is stale.
        await lb.acquire_server.remote(request_id="a", prompt_ids=[1, 2, 3] + [0] * 12, sampling_params={})
        await lb.release_server.remote(server_id=a, request_id="a", generated_tokens=12, finished=False)
        out["inflight_after_out_of_order"] = await lb.get_total_inflight.remote()
        await lb.release_server.remote(server_id=a, request_id="a", generated_tokens=16, finished=True)
        await lb.release_server.remote(server_id=b, request_id="b")  # verl's plain client: finished
        status = await lb.get_status.remote()
        out["status_keys"] = sorted(status)
        out["status_policy_verl_default"] = status["policy"]
        out["finished"] = status["policy"]["finished"]
        out["inflight_0"] = await lb.get_total_inflight.remote()
        # A finished request id acquired again is a new turn.
        await lb.acquire_server.remote(request_id="a", prompt_ids=[1, 2, 3, 9, 9], sampling_params={})
        out["turn"] = await lb.conversation.remote("a")
        out["cleared"] = (await lb.clear_sticky_cache.remote())["cleared_entries"]
        # verl_default never moves a sequence: its chunk is the rest, in one piece.
        out["chunk_verl_default"] = (await lb.acquire_chunk.remote(request_id="c", prompt_ids=[6],
                                                                   sampling_params={"max_tokens": 16}))[2]

        # tail_aware with one slot per replica: the third request waits until a slot frees.
        lb = router("tail_aware", 1)
        first = [await lb.acquire_server.remote(request_id=r, prompt_ids=[7, i], sampling_params={"max_tokens": 64})
                 for i, r in enumerate(("x", "y"))]
        out["two_replicas_used"] = len({s for s, _ in first}) == 2
        parked = lb.acquire_server.remote(request_id="z", prompt_ids=[7, 9], sampling_params={"max_tokens": 64})
        done, _ = ray.wait([parked], timeout=1.0)
        out["parked_while_full"] = not done
        await lb.release_server.remote(server_id=first[0][0], request_id="x", generated_tokens=5, finished=True)
        out["placed_after_release"] = (await parked)[0] == first[0][0]
        # The router passes wall time: x's chunk (5 tokens) is one sample of the step-model fit.
        out["fit"] = (await lb.get_status.remote())["policy"].get("step_model_fit")

        # remove_servers hands the replica's in-flight requests back; they re-acquire elsewhere.
        orphans = await lb.remove_servers.remote([first[1][0]])
        out["orphans"] = orphans
        out["servers_left"] = await lb.get_all_servers.remote()
        await lb.release_server.remote(server_id=first[0][0], request_id="z", generated_tokens=8, finished=False)
        moved, _ = await lb.acquire_server.remote(request_id="y", prompt_ids=[7, 1] + [0] * 8, sampling_params={})
        out["orphan_redispatched_to"] = moved
        await lb.remove_servers.remote(await lb.get_all_servers.remote())
        try:
            await lb.acquire_server.remote(request_id="w", prompt_ids=[1], sampling_params={})
            out["empty_pool_error"] = None
        except ray.exceptions.RayTaskError as e:
            out["empty_pool_error"] = str(e.cause) if hasattr(e, "cause") else str(e)
        await lb.add_servers.remote({"s9": Server.remote()})
        out["added"] = await lb.get_all_servers.remote()
        # tail_aware may move it at the next boundary: the router's chunk.
        placed, _, chunk = await lb.acquire_chunk.remote(request_id="v", prompt_ids=[3],
                                                         sampling_params={"max_tokens": 64})
        out["chunk_tail_aware"] = [placed, chunk]

    def epochs() -> dict:
        """patches/verl_epoch_end.py's end_epoch on each trainer layout: v1 separate_async (two managers,
        the standalone one routes), one-step-off (one manager, no `_rollout_server_managers`), the fully
        async trainer (no router)."""
        from types import SimpleNamespace

        from rollout_ext.patches.verl_epoch_end import end_epoch

        idle, routing = router("tail_aware", 4), router("tail_aware", 4)
        ray.get(routing.acquire_server.remote(request_id="e", prompt_ids=[4], sampling_params={"max_tokens": 8}))
        managers = [SimpleNamespace(global_load_balancer=idle), SimpleNamespace(global_load_balancer=routing)]
        separate = SimpleNamespace(_rollout_server_managers=lambda: managers)
        one_step_off = SimpleNamespace(llm_server_manager=managers[1])
        seen = {"separate": end_epoch(separate), "one_step_off": end_epoch(one_step_off),
                "idle_after": ray.get(idle.end_epoch.remote())["epochs"],
                "no_router": end_epoch(SimpleNamespace())}
        seen["fully_async"] = asyncio.run(fully_async(routing))
        return seen

    async def fully_async(routing) -> dict:
        """verl's own FullyAsyncRollouter.reset_staleness, as patched, run on a stand-in holding the state it
        reads (the rollouter actor itself starts a whole training job)."""
        import collections
        import time
        from types import SimpleNamespace

        from omegaconf import OmegaConf
        from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

        class Queue:
            async def get_queue_size(self):
                return 0

        now = time.time()
        rollouter = SimpleNamespace(
            config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "rollout_ext"}}}),
            llm_server_manager=SimpleNamespace(global_load_balancer=routing), lock=asyncio.Lock(), paused=True,
            _resume_event=asyncio.Event(), active_tasks=set(), message_queue_client=Queue(), staleness_samples=0,
            step_start_time=now - 1, idle_start_time=now - 2, _step_generated_samples=4, _completed_steps=0,
            _step_samples_history=collections.deque(maxlen=8), _STEP_HISTORY_SIZE=8,
            _compute_rollout_resource_utilization=lambda: 1.0)
        method = FullyAsyncRollouter.__ray_metadata__.modified_class.reset_staleness
        timing = await method(rollouter)
        return {"patched": method.__code__.co_filename.endswith("verl_epoch_end_fully_async.py"),
                "epochs": timing.get("rollout_ext/router_epochs"),
                "verl_keys": "fully_async/rollouter/version_time" in timing, "resumed": not rollouter.paused}

    async def pause(tell_abort: bool) -> dict:
        """Two replicas of one slot, a third request waiting; verl closes both gates and aborts the two
        running chunks. With `tell_abort` (our client) the router places nothing until the gates reopen;
        without it (verl's plain release) the control."""
        path = tmp / f"pause-{tell_abort}.yaml"
        path.write_text("router_class: rollout_ext.verl.router.TailAwareRouterActor\npolicy: tail_aware\n"
                        "slots_per_replica: 1\nchunk_tokens: 8\n")
        servers = {f"g{i}": GatedServer.remote() for i in range(2)}
        lb = get_router_handle(servers, router_config_path=str(path))
        params = {"max_tokens": 64}
        first = {}
        for i, rid in enumerate(("p1", "p2")):
            first[rid], _, _ = await lb.acquire_chunk.remote(request_id=rid, prompt_ids=[1, i], sampling_params=params)
        waiting = asyncio.ensure_future(lb.acquire_chunk.remote(request_id="p3", prompt_ids=[1, 9], sampling_params=params))
        await asyncio.sleep(0.2)
        seen = {"waiting_parked": not waiting.done()}
        await asyncio.gather(*(h.set_open.remote(False) for h in servers.values()))
        extra = {"aborted": True} if tell_abort else {}
        for rid in ("p1", "p2"):
            await lb.release_server.remote(server_id=first[rid], request_id=rid, generated_tokens=5,
                                           finished=None if not tell_abort else False, **extra)
        resume = asyncio.ensure_future(lb.acquire_chunk.remote(request_id="p1", prompt_ids=[1, 0] + [0] * 5,
                                                               sampling_params=params))
        inflight = []
        for _ in range(6):  # 0.6 s with the gates closed
            await asyncio.sleep(0.1)
            inflight.append(await lb.get_total_inflight.remote())
        status = await lb.get_status.remote()
        seen.update(inflight_while_closed=inflight, placed_while_closed=waiting.done() or resume.done(),
                    paused=status["paused"], held=status["held"], parked=status["waiting"], turns=(await lb.conversation.remote("p1"))["turns"])
        await asyncio.gather(*(h.set_open.remote(True) for h in servers.values()))
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(asyncio.gather(waiting, resume), timeout=5)
        seen["reopened_s"] = asyncio.get_running_loop().time() - t0
        seen["inflight_after_open"] = await lb.get_total_inflight.remote()
        conv = await lb.conversation.remote("p1")
        seen["turns_after"], seen["finished_after"] = conv["turns"], conv["finished"]
        seen["policy_finished"] = (await lb.get_status.remote())["policy"]["finished"]
        return seen

    asyncio.run(run())
    out["epochs"] = epochs()
    out["pause"] = asyncio.run(pause(tell_abort=True))
    out["pause_control"] = asyncio.run(pause(tell_abort=False))
    return out


def main(tmp: str) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print("REPORT" + json.dumps(_scenarios(Path(tmp))))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from rollout_ext.config import environ_copy

    env = {**environ_copy(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(REPO)}
    tmp = tmp_path_factory.mktemp("router")
    done = subprocess.run([sys.executable, __file__, str(tmp)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, (done.stdout[-3000:], done.stderr[-5000:])
    return json.loads(lines[-1][len("REPORT"):])


def test_router_has_every_protocol_method(report):
    assert report["missing_methods"] == []
    assert report["fields"] == [["prompt_ids", "sampling_params"], ["request_id"]]
    assert report["chunk_tokens"] == 8


def test_verl_default_spreads_sticks_and_counts(report):
    assert report["spread"] and report["sticky"] and report["handle_works"]
    assert report["inflight_2"] == 2
    assert report["inflight_after_out_of_order"] == 2
    assert report["inflight_0"] == 0 and report["finished"] == 2
    assert {"servers", "total_inflight", "active_servers", "policy", "router_cpu_s"} <= set(report["status_keys"])


def test_finished_request_id_starts_a_new_turn(report):
    assert report["turn"]["turns"] == 2 and not report["turn"]["finished"]
    assert report["turn"]["replica"] == report["first_replica_a"]  # the conversation stays on its replica
    assert report["cleared"] == 1  # "b" finished; "a" is live again in its second turn


def test_parked_acquire_waits_for_a_free_slot(report):
    assert report["two_replicas_used"]
    assert report["parked_while_full"]
    assert report["placed_after_release"]


def test_tail_aware_times_chunks_on_the_router_clock(report):
    assert report["fit"]["chunks"] == 1, report["fit"]
    assert "step_model_fit" not in report["status_policy_verl_default"]  # control: a policy without a fit


def test_acquire_chunk_gives_chunks_only_where_the_policy_may_move(report):
    assert report["chunk_tail_aware"] == ["s9", 8]
    assert report["chunk_verl_default"] == 0  # the control: a policy that never moves


def test_removed_replica_hands_back_its_requests(report):
    assert report["orphans"] == ["y"]
    assert len(report["servers_left"]) == 1
    assert report["orphan_redispatched_to"] == report["servers_left"][0]
    assert "No available servers" in report["empty_pool_error"]
    assert report["added"] == ["s9"]


def test_epoch_end_closes_the_router_that_routes_in_each_trainer_layout(report):
    seen = report["epochs"]
    # separate_async: both routers closed, the standalone one (it placed the request) reports.
    assert seen["separate"]["epochs"] == 1 and seen["separate"]["acquires"] == 1
    assert seen["idle_after"] == 2  # the idle router was closed once by end_epoch, once here
    assert seen["one_step_off"]["epochs"] == 2 and seen["one_step_off"]["acquires"] == 1
    assert seen["no_router"] is None
    # fully async: verl's reset_staleness ran (its own keys, the rollouter resumed) and closed the epoch.
    assert seen["fully_async"] == {"patched": True, "epochs": 3, "verl_keys": True, "resumed": True}


def test_an_aborted_release_holds_placement_until_the_replicas_reopen(report):
    seen = report["pause"]
    assert seen["waiting_parked"]
    # verl's rebalance_requests polls get_total_inflight for 0: it drains and stays there.
    assert seen["inflight_while_closed"] == [0] * 6, seen
    # The resume waits at the router's gate; the request that was waiting for a slot stays parked.
    assert not seen["placed_while_closed"] and seen["paused"] and seen["held"] == 1 and seen["parked"] == 1, seen
    # The aborted sequence resumes under its own record: the same turn, not finished.
    assert seen["turns"] == seen["turns_after"] == 1 and not seen["finished_after"]
    assert seen["policy_finished"] == 0
    assert seen["reopened_s"] < 1.0 and seen["inflight_after_open"] == 2


def test_control_a_plain_release_is_read_as_finished_and_placement_goes_on(report):
    seen = report["pause_control"]
    assert seen["waiting_parked"]
    assert seen["placed_while_closed"] and not seen["paused"]
    assert 0 not in seen["inflight_while_closed"][1:], seen  # the waiting request was sent to a closed gate
    assert seen["turns_after"] == 2 and seen["policy_finished"] == 2  # the resume is a new turn


if __name__ == "__main__":
    main(sys.argv[1])
