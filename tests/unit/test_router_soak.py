"""A long job through TailAwareRouter: 500 steps, each closed with end_epoch() and clear_sticky_cache() as verl
closes them. What the router and its policy keep per request must be gone after every step, and memory must
stay flat. Plus multi-turn stickiness: a conversation's later turn goes back to its replica.

The router class is driven in this process (its async methods on one event loop, as in its Ray actor);
replica handles are plain objects, since the router only hands them back.
"""

from __future__ import annotations

import asyncio
import gc
import random
import tracemalloc

import pytest

from rollout_ext.verl.router import TailAwareRouter

PROMPTS = 24  # the job's data set: every step draws its prompts from these, as epochs over a data set do
CHUNK_TOKENS = 64


def _sizes(router: TailAwareRouter) -> dict[str, int]:
    """Every structure of the router, its policy and predictor that holds something per request or group."""
    policy, predictor = router.policy, router.policy.predictor
    return {
        "router.live": len(router._live),
        "router.sticky": len(router._sticky),
        "router.group_sizes": len(router._group_sizes),
        "policy.seqs": len(policy.seqs),
        "policy.groups": len(policy.groups),
        "policy.queue": len(policy._queue),
        "policy.short": len(policy._short),
        "policy.running": sum(rep.batch for rep in policy.replicas.values()),
        "predictor.groups": len(predictor._groups),
        "predictor.epoch": len(predictor._epoch),
    }


async def _step(router: TailAwareRouter, step: int, rng: random.Random, prompts: int, samples: int) -> None:
    """One rollout step: `prompts` x `samples` requests at once, each generated chunk by chunk."""

    async def request(rid: str, prompt: list[int], length: int) -> None:
        generated = 0
        while True:
            server, _, chunk = await router.acquire_chunk(rid, prompt_ids=prompt + [0] * generated,
                                                          sampling_params={"max_tokens": 512})
            await asyncio.sleep(0)  # the chunk "runs": every other caller gets the loop meanwhile
            generated = min(length, generated + (chunk or length))
            router.release_server(server, rid, generated_tokens=generated, finished=generated >= length)
            if generated >= length:
                return

    jobs = []
    for p in rng.sample(range(PROMPTS), prompts):
        prompt = [p + 1] * (8 + p)
        jobs += [request(f"s{step}-p{p}-{i}", prompt, rng.randint(1, 4) * 50 + 10 * p) for i in range(samples)]
    await asyncio.gather(*jobs)


def _soak(steps: int, *, end_epoch: bool = True, clear: bool = True, trace_at: int = 20) -> dict:
    router = TailAwareRouter({f"r{i}": object() for i in range(3)},
                             {"policy": "tail_aware", "slots_per_replica": 6, "chunk_tokens": CHUNK_TOKENS})
    rng = random.Random(0)
    start = _sizes(router)
    grown, traced = [], {}
    tracemalloc.start()
    try:
        for step in range(1, steps + 1):
            asyncio.run(_step(router, step, rng, prompts=8, samples=4))
            if end_epoch:
                router.end_epoch()
            if clear:
                router.clear_sticky_cache()
            sizes = _sizes(router)
            if sizes != start:
                grown.append((step, {k: v for k, v in sizes.items() if v != start[k]}))
            if step in (trace_at, steps):
                gc.collect()
                traced[step] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return {"router": router, "grown": grown, "traced": traced, "start": start}


def test_a_long_job_leaves_nothing_behind_and_memory_flat():
    out = _soak(500)
    router = out["router"]
    assert out["grown"] == []  # every per-request structure is back to its start size after each step
    assert out["traced"][500] <= 1.2 * out["traced"][20], out["traced"]
    assert router.policy.finished == 500 * 8 * 4  # every request ran to its end
    assert len(router.policy.predictor._history) <= PROMPTS  # history is bounded by the data set
    assert router.policy.predictor.calibration()["finished"] == 500 * 8 * 4


def test_control_the_soak_sees_what_a_step_leaves_behind():
    """Without clear_sticky_cache the finished conversations stay, without end_epoch the predictor's batch
    does: the check above must see both."""
    out = _soak(3, end_epoch=False, clear=False, trace_at=1)
    grown = dict(out["grown"])
    assert grown[1]["router.sticky"] == 32 and grown[3]["router.sticky"] == 96
    assert grown[1]["predictor.epoch"] == 8


async def _turns(policy: str) -> dict:
    router = TailAwareRouter({"r0": "h0", "r1": "h1"}, {"policy": policy, "slots_per_replica": 4, "chunk_tokens": 0})
    prompt = [5, 6, 7]
    first, _ = await router.acquire_server("conv", prompt_ids=prompt, sampling_params={"max_tokens": 64})
    router.release_server(first, "conv", generated_tokens=20, finished=True)
    # The first turn's replica is now the busier one: a long request runs there.
    hog, _ = await router.acquire_server("hog", prompt_ids=[9] * 50, sampling_params={"max_tokens": 4096})
    assert hog == first
    second, _ = await router.acquire_server("conv", prompt_ids=prompt + [1] * 20 + [8, 8],
                                            sampling_params={"max_tokens": 64})
    fresh, _ = await router.acquire_server("fresh", prompt_ids=prompt + [1] * 20 + [8, 8],
                                           sampling_params={"max_tokens": 64})
    return {"first": first, "second": second, "fresh": fresh, "conversation": router.conversation("conv"),
            "fresh_group": router.conversation("fresh")["group"]}


@pytest.mark.parametrize("policy", ["verl_default", "tail_aware_placement", "tail_aware"])
def test_a_later_turn_goes_back_to_its_conversations_replica(policy):
    out = asyncio.run(_turns(policy))
    assert out["second"] == out["first"]
    # Control: the same text as a new request id has no home, and goes to the idle replica.
    assert out["fresh"] != out["first"]
    conv = out["conversation"]
    assert conv["turns"] == 2 and conv["replica"] == out["first"]
    assert conv["group"] != out["fresh_group"]  # the later turn keeps its first turn's group
