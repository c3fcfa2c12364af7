"""How fast the load-balancing router actor itself answers, at production scale (no engines).

verl 0.9.1 sends every generate request through one router Ray actor: `acquire_server` picks a
replica, `release_server` hands it back. With chunked continuation (rollout_ext/verl/continuation.py)
that is one acquire/release pair per chunk, so at 10,000 live requests one actor answers thousands
of calls a second. This bench measures that actor alone:

- R replica "servers" are trivial Ray actors (`num_cpus=0`): the router only hands out their handles.
- The router under test is started exactly as verl starts it, `get_router_handle(servers)` for verl's
  own `GlobalRequestLoadBalancer`, or `get_router_handle(servers, router_config_path=YAML)` for ours
  (`rollout_ext.verl.router.TailAwareRouterActor`, the YAML written to a temp dir).
- C caller actors (async, `num_cpus=0`) each own N/C request lanes, so N requests are live at once.
  A lane runs one request chunk by chunk: acquire -> optional hold (`--hold-ms`) -> release -> next
  chunk, then starts a fresh request id. It calls the router the way the clients do:
  ours like ChunkedLLMServerClient (`acquire_chunk(request_id, prompt_ids=prompt + generated,
  sampling_params={"max_tokens": cap})`, then `release_server(server_id, request_id,
  generated_tokens, finished)`; the router's chunk answer is obeyed: 0 = the rest in one piece,
  unless `--fixed-chunks`); verl's with the fields its `require_acquire_fields` /
  `require_release_fields` ask for (none beyond the ids), one pair per `--chunk-tokens` chunk.
  Releases are awaited (verl's plain client fires them and forgets), so that their latency is seen.
- Requests come from a seeded, deterministic stream per lane: prompts from a fixed pool
  (`--prompts`, lognormal lengths) with `--samples` siblings each (a GRPO group, same prompt tokens),
  response lengths lognormal with a per-prompt effect, capped at `--cap`. Every router gets the
  same stream (same `--seed`); each router runs in a fresh actor with fresh callers.

Load. By default the lanes run a closed loop: each calls again as soon as it is answered, which
measures the most pairs/s the router gives; its latency is then queueing (about live / throughput:
at 10,000 lanes no router can show a 20 ms p99 that way). `--offered-pairs-per-s X` paces the
lanes instead: each chunk holds its replica for a jittered live / X seconds on average (its
generation), so together they offer about X pairs/s while the calls are fast, and latency is what a
call costs at that load. A slow router lowers the load it is offered, as real clients would; the
verdict checks that it kept up. `--hold-ms` is a fixed hold in the closed loop.

After `--warmup-pairs` pairs (default: one per live request), each caller measures for `--seconds`
on its own clock (or until at least `--pairs` pairs in all). Reported per router: aggregate
acquire+release pairs per second, p50/p99 latency of acquire and of release calls as the callers see
them (ms), the router process's RSS at start and end (psutil on the pid the actor reports through
`__ray_call__`), its CPU over the window and per pair (`router_cpu_ms_per_pair`; 1000 / it is what
the router answers with a whole core of this speed to itself), the callers' CPU, how many lanes sat
in an acquire call on average, and how many of them our policy had parked for a slot.

Target (the production size, 10,000 live requests on 128 replicas): >= 2,000 pairs/s with p99 < 20 ms
for both calls. A closed-loop run is judged on throughput only; a paced run must offer >= 2,000 pairs/s,
keep up with it, and hold both p99s. Where the policy parks acquires for slots (N > R x S), acquire
latency is time in the queue and the verdict is n/a.

The host is shared: the router, the callers, Ray's own processes and every server actor (an idle Ray
worker still costs CPU: 128 of them take about one core of a small host; `--server-actors K` puts the
R server ids on K processes, the router sees no difference). Read `router_cpu_util` (1.0 = its process
is saturated) and `router_cpu_ms_per_pair` next to the callers' CPU and the host's cores.

Where the router's CPU goes: `--profile-dir DIR` samples its process with py-spy over the window and
reports the functions with the largest share of its samples and the share with router code on the
stack (the rest is Ray's call machinery). The reference routers `floor_sync` / `floor_async` answer
our protocol with no logic at all, on a plain and on an asyncio actor: their CPU per pair is Ray's
own cost for the same payloads, the floor any router of that kind pays.

Without Ray: `--in-process` runs the same lanes and the same router classes on one event loop in this
process, calling the router's methods directly. It shows what the routing logic costs apart from
Ray's per-call cost (the router CPU then includes the lanes'), i.e. whether the policy or the actor
transport is the bound.

Examples:
    # the target size, closed loop (most pairs/s), and paced at the target load (latency)
    .venv/bin/python bench/router_scale.py --live 10000 --replicas 128 --seconds 30 --json /tmp/closed.json
    .venv/bin/python bench/router_scale.py --live 10000 --replicas 128 --offered-pairs-per-s 2000 \
        --seconds 30 --profile-dir /tmp/prof --json /tmp/paced.json --plot /tmp/paced.png
    # requests waiting for slots: 6,000 live on 4 x 1,000 slots, ~2,000 parked at any time
    .venv/bin/python bench/router_scale.py --live 6000 --replicas 4 --slots 1000 --routers ours_tail_aware
    # what Ray alone costs per pair, next to the routers
    .venv/bin/python bench/router_scale.py --live 1000 --routers floor_sync,floor_async,verl_default,ours_verl_default
    # the routing logic alone, no Ray
    .venv/bin/python bench/router_scale.py --in-process --live 10000 --replicas 128 --seconds 20
    # tiny smoke run (what tests/unit/test_router_scale_bench.py runs)
    .venv/bin/python bench/router_scale.py --live 200 --replicas 4 --slots 16 --callers 2 --pairs 300
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import inspect
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Ray reads these at import time; the bench must run with or without the caller setting them.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from bench.flags import check as _check  # noqa: E402

OUR_CLASS = "rollout_ext.verl.router.TailAwareRouterActor"
OUR_PREFIX = "ours_"
VERL_ROUTER = "verl_default"  # verl's own GlobalRequestLoadBalancer
DEFAULT_ROUTERS = "verl_default,ours_verl_default,ours_tail_aware"
TARGET_PAIRS_PER_S = 2000.0
TARGET_P99_MS = 20.0
TARGET_SIZE = (10_000, 128)  # live requests, replicas the target is stated for
# A paced run's pair count over a window is random (jittered holds): it has kept up within this share.
KEEP_UP_SHARE = 0.97
# A run counts as a waiting regime when the policy holds back this share of the live requests for a slot
# on average: acquire latency is then time in its queue, not the router's answer time.
WAITING_SHARE = 0.01
# Source files whose content decides what the router does; hashed into the JSON because the router
# may change between runs in a shared checkout.
ROUTER_SOURCES = ("rollout_ext/verl/router.py", "rollout_ext/balance")


def our_policies() -> tuple[str, ...]:
    from rollout_ext.verl.router import POLICY_NAMES

    return tuple(POLICY_NAMES)


def router_names() -> list[str]:
    return [VERL_ROUTER] + [OUR_PREFIX + p for p in our_policies()] + list(FLOORS)


# ---- flags ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--live", type=int, default=10_000, help="requests live at once (lanes)")
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--slots", type=int, default=256, help="slots_per_replica of our router")
    p.add_argument("--callers", type=int, default=8, help="caller actors; each owns live/callers lanes")
    p.add_argument("--server-actors", type=int, default=None,
                   help="actor processes behind the R server ids (default R; each idle Ray worker costs some CPU, "
                        "which a small host feels at R=128)")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--fixed-chunks", action="store_true",
                   help="chunk every request at --chunk-tokens even where our router answers 0 (one piece)")
    p.add_argument("--hold-ms", type=float, default=0.0, help="time a lane holds its replica per chunk")
    p.add_argument("--offered-pairs-per-s", type=float, default=None,
                   help="pace the lanes to offer about this many pairs/s in all (each chunk holds its replica "
                        "a jittered live/X seconds, as a generation would); "
                        "default: closed loop, every lane as fast as the router answers")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--seconds", type=float, default=None, help="measured window (default 20)")
    window.add_argument("--pairs", type=int, default=None, help="measure until at least this many pairs")
    p.add_argument("--warmup-pairs", type=int, default=None, help="pairs before measuring (default: --live)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on one router run after this")
    p.add_argument("--routers", default=DEFAULT_ROUTERS,
                   help="comma list: verl_default (verl's class), ours_<policy> for our router's policies, and "
                        "the references floor_sync / floor_async (Ray's call cost alone, no routing logic)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prompts", type=int, default=512, help="prompt pool size")
    p.add_argument("--samples", type=int, default=16, help="siblings per prompt (a group)")
    p.add_argument("--mean-tokens", type=float, default=3000.0, help="mean response length")
    p.add_argument("--cap", type=int, default=20480, help="max_tokens of every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=None, help="Ray num_cpus (default: this host's cores)")
    p.add_argument("--progress-s", type=float, default=2.0, help="seconds between progress lines")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: pairs/s and p99 per router")
    p.add_argument("--profile-dir", default=None, help="py-spy the router over the window, stacks here")
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: the router object and every lane on one event loop in this process, which "
                        "measures the routing logic alone (its CPU includes the lanes')")
    a = p.parse_args(argv)
    _check("--live", a.live, a.live >= 1, "integer >= 1")
    _check("--replicas", a.replicas, a.replicas >= 1, "integer >= 1")
    _check("--slots", a.slots, a.slots >= 1, "integer >= 1")
    _check("--callers", a.callers, 1 <= a.callers <= a.live, f"1 <= integer <= --live ({a.live})")
    if a.server_actors is None:
        a.server_actors = a.replicas
    _check("--server-actors", a.server_actors, 1 <= a.server_actors <= a.replicas,
           f"1 <= integer <= --replicas ({a.replicas})")
    _check("--chunk-tokens", a.chunk_tokens, a.chunk_tokens >= 1, "integer >= 1")
    _check("--hold-ms", a.hold_ms, a.hold_ms >= 0, "number >= 0")
    if a.offered_pairs_per_s is not None:
        _check("--offered-pairs-per-s", a.offered_pairs_per_s, a.offered_pairs_per_s > 0, "number > 0")
        _check("--hold-ms", a.hold_ms, a.hold_ms == 0, "0 with --offered-pairs-per-s (the pacing sets the hold)")
    if a.pairs is None and a.seconds is None:
        a.seconds = 20.0
    if a.seconds is not None:
        _check("--seconds", a.seconds, a.seconds > 0, "number > 0")
    if a.pairs is not None:
        _check("--pairs", a.pairs, a.pairs >= 1, "integer >= 1")
    if a.warmup_pairs is None:
        a.warmup_pairs = a.live
    _check("--warmup-pairs", a.warmup_pairs, a.warmup_pairs >= 0, "integer >= 0")
    _check("--timeout-s", a.timeout_s, a.timeout_s > 0, "number > 0")
    _check("--repeats", a.repeats, a.repeats >= 1, "integer >= 1")
    _check("--prompts", a.prompts, a.prompts >= 1, "integer >= 1")
    _check("--samples", a.samples, a.samples >= 1, "integer >= 1")
    _check("--cap", a.cap, a.cap >= 2, "integer >= 2")
    _check("--mean-tokens", a.mean_tokens, 1 <= a.mean_tokens < a.cap, f"1 <= value < --cap ({a.cap})")
    _check("--progress-s", a.progress_s, a.progress_s > 0, "number > 0")
    if a.in_process:
        _check("--profile-dir", a.profile_dir, a.profile_dir is None,
               "unset with --in-process (py-spy watches a router actor; run py-spy on this process instead)")
    if a.num_cpus is not None:
        _check("--num-cpus", a.num_cpus, a.num_cpus >= 1, "integer >= 1")
    allowed = router_names()
    a.router_list = [x.strip() for x in a.routers.split(",") if x.strip()]
    bad = [x for x in a.router_list if x not in allowed]
    _check("--routers", ",".join(bad) or a.routers, not bad and bool(a.router_list), ", ".join(allowed))
    if len(set(a.router_list)) != len(a.router_list):
        _check("--routers", a.routers, False, "each router at most once")
    return a


# ---- workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Everything a lane needs to produce its request stream; identical for every router."""

    seed: int
    live: int
    samples: int
    cap: int
    mu_log: float  # mean log length without the prompt effect
    sd_sample_log: float  # per-sample spread of log length
    prompts: tuple[tuple[int, ...], ...]
    prompt_effects: tuple[float, ...]  # per-prompt shift of log length (siblings share it)

    def request(self, lane: int, k: int, rng: random.Random) -> tuple[str, int, int]:
        """(request id, prompt index, response length) of lane's k-th request. `rng` is the lane's own
        stream, drawn once per request in order, so the sequence depends on (seed, lane, k) only."""
        # Lanes next to each other run the siblings of one prompt, so groups are live together.
        prompt = ((k * self.live + lane) // self.samples) % len(self.prompts)
        log_len = self.mu_log + self.prompt_effects[prompt] + self.sd_sample_log * rng.gauss(0.0, 1.0)
        length = int(min(self.cap, max(1.0, round(math.exp(log_len)))))
        return f"req-{lane}-{k}", prompt, length


SD_PROMPT_LOG = 0.6  # prompt effect: how far one prompt's samples sit from the population, log scale
SD_SAMPLE_LOG = 0.8
PROMPT_MEAN_TOKENS = 400.0
PROMPT_SD_LOG = 0.5
PROMPT_TOKENS_RANGE = (16, 4096)


def make_workload(a: argparse.Namespace) -> Workload:
    rng = random.Random(f"router-scale-pool-{a.seed}")
    lo, hi = PROMPT_TOKENS_RANGE
    prompts, effects = [], []
    for _ in range(a.prompts):
        n = int(min(hi, max(lo, round(rng.lognormvariate(math.log(PROMPT_MEAN_TOKENS) - PROMPT_SD_LOG**2 / 2,
                                                        PROMPT_SD_LOG)))))
        prompts.append(tuple(rng.randrange(3, 150_000) for _ in range(n)))
        effects.append(rng.gauss(0.0, SD_PROMPT_LOG))
    # Lognormal mean = exp(mu + var / 2): pick mu so the uncapped mean is --mean-tokens.
    mu = math.log(a.mean_tokens) - (SD_PROMPT_LOG**2 + SD_SAMPLE_LOG**2) / 2
    return Workload(a.seed, a.live, a.samples, a.cap, mu, SD_SAMPLE_LOG, tuple(prompts), tuple(effects))


def lane_rng(seed: int, lane: int) -> random.Random:
    return random.Random(f"router-scale-lane-{seed}-{lane}")  # str seeds hash the same in every process


def lanes_of(caller: int, callers: int, live: int) -> list[int]:
    """Contiguous lanes per caller, so a group's siblings mostly share a caller (like one worker's batch)."""
    per, extra = divmod(live, callers)
    start = caller * per + min(caller, extra)
    return list(range(start, start + per + (1 if caller < extra else 0)))


# ---- actors -----------------------------------------------------------------------------------
def _parked_probe(router) -> int:
    """Runs inside our router through `__ray_call__`: acquires its policy holds back for a free slot."""
    waiting = getattr(getattr(router, "policy", None), "waiting", None)
    return int(waiting()) if callable(waiting) else 0


def _process_probe(_self) -> dict:
    """Runs inside an actor through `__ray_call__`: which process to watch from the driver."""
    import os as _os

    import psutil as _psutil

    return {"pid": _os.getpid(), "rss_bytes": _psutil.Process().memory_info().rss}


class CallerImpl:
    """One caller actor: many lanes, each an asyncio task that keeps one request live."""

    def __init__(self, router, ours: bool, lanes: list[int], workload: Workload, chunk_tokens: int,
                 fixed_chunks: bool, hold_s: float, period_s: float | None) -> None:
        self.router, self.ours, self.lanes, self.workload = router, ours, lanes, workload
        self.chunk_tokens, self.fixed_chunks, self.hold_s = chunk_tokens, fixed_chunks, hold_s
        self.period_s = period_s  # paced: a chunk's mean hold (its generation time)
        # Generated tokens are appended from here: only the list's length matters to the router.
        self.filler = list(range(1000, 1000 + workload.cap))
        self.stopping = False
        self.measuring = False
        self.pairs = 0  # completed pairs, warm-up included
        self.pending = 0  # lanes inside an acquire call now
        self.requests_started = 0
        self.requests_finished = 0
        self.errors: list[str] = []
        self.window = [0.0, 0.0]
        self.until = math.inf  # a timed window closes here, on this caller's clock
        self.cpu_s = [0.0, 0.0]
        self.m = self._empty_samples()

    @staticmethod
    def _empty_samples() -> dict:
        return {"pairs": 0, "acquire_first_ms": [], "acquire_next_ms": [], "release_ms": [], "requests_finished": 0,
                "chunk_answers": Counter()}

    async def run(self) -> dict:
        if self.ours:
            acquire_fields, release_fields = ["prompt_ids", "sampling_params"], ["request_id"]
        else:
            # Like verl's LLMServerClient: send only what the router declares.
            acquire_fields, release_fields = await asyncio.gather(self.router.require_acquire_fields.remote(),
                                                                  self.router.require_release_fields.remote())
        self.acquire_fields, self.release_fields = set(acquire_fields), set(release_fields)
        await asyncio.gather(*(self._lane(lane) for lane in self.lanes))
        return {"errors": self.errors[:5], "error_count": len(self.errors)}

    async def _lane(self, lane: int) -> None:
        rng = lane_rng(self.workload.seed, lane)
        # Its own stream for the holds: pacing must not change which requests a lane runs.
        pace = random.Random(f"router-scale-hold-{self.workload.seed}-{lane}")
        k = 0
        try:
            if self.period_s:
                # Paced lanes arrive spread over one hold, as in a rollout under way: all 10,000 at once is a
                # burst that takes a slow router many holds to smooth out, and the window would see its echo.
                await asyncio.sleep(pace.uniform(0.0, self.period_s))
            while not self.stopping:
                await self._request(lane, k, rng, pace)
                k += 1
        except Exception as e:  # noqa: BLE001 - a lane reports its error and stops; the bench goes on
            self.errors.append(f"lane {lane}: {type(e).__name__}: {e}"[:500])

    async def _request(self, lane: int, k: int, rng: random.Random, pace: random.Random) -> None:
        request_id, prompt_index, length = self.workload.request(lane, k, rng)
        prompt = list(self.workload.prompts[prompt_index])
        sampling = {"max_tokens": self.workload.cap}
        self.requests_started += 1
        generated = 0
        while True:
            context = prompt + self.filler[:generated] if generated else prompt
            started = time.perf_counter()
            self.pending += 1
            try:
                server_id, chunk = await self._acquire(request_id, context, sampling)
            finally:
                self.pending -= 1
            acquired = time.perf_counter()
            await self._hold(pace)
            # Our client runs the rest in one piece where the router answers 0 (it will never move it).
            step = length - generated if chunk <= 0 else min(chunk, length - generated)
            generated += step
            finished = generated >= length
            released = time.perf_counter()
            await self._release(server_id, request_id, generated, finished)
            done = time.perf_counter()
            if self.measuring and done <= self.until:
                key = "acquire_next_ms" if generated - step else "acquire_first_ms"
                self.m[key].append(1e3 * (acquired - started))
                self.m["release_ms"].append(1e3 * (done - released))
                self.m["pairs"] += 1
                self.m["chunk_answers"]["rest" if chunk <= 0 else "chunk"] += 1
                self.m["requests_finished"] += finished
            self.pairs += 1
            self.requests_finished += finished
            # A stop takes effect at a release: the slot is free then, so parked lanes still get one.
            if finished or self.stopping:
                return

    async def _hold(self, pace: random.Random) -> None:
        """The chunk's generation. Paced: a mean of `period_s`, jittered so that lanes that started together
        drift apart; it starts when the acquire returns, as a generation does, so a slow or parked acquire
        lowers the load a lane offers (the verdict checks that the router kept up)."""
        if self.period_s:
            await asyncio.sleep(self.period_s * pace.uniform(0.5, 1.5))
        elif self.hold_s:
            await asyncio.sleep(self.hold_s)

    async def _acquire(self, request_id: str, context: list[int], sampling: dict) -> tuple[str, int]:
        if self.ours:
            server_id, _handle, answer = await self.router.acquire_chunk.remote(
                request_id=request_id, prompt_ids=context, sampling_params=sampling)
            if self.fixed_chunks:
                return server_id, self.chunk_tokens
            # As ChunkedLLMServerClient reads the answer: 0 = the rest, else at least our chunk.
            return server_id, max(answer, self.chunk_tokens) if answer else 0
        offered = {"prompt_ids": context, "sampling_params": sampling}
        fields = {name: offered[name] for name in self.acquire_fields if name in offered}
        server_id, _handle = await self.router.acquire_server.remote(request_id=request_id, **fields)
        return server_id, self.chunk_tokens

    async def _release(self, server_id: str, request_id: str, generated: int, finished: bool) -> None:
        if self.ours:
            await self.router.release_server.remote(server_id=server_id, request_id=request_id,
                                                    generated_tokens=generated, finished=finished)
            return
        fields = {"request_id": request_id} if "request_id" in self.release_fields else {}
        await self.router.release_server.remote(server_id=server_id, **fields)

    async def counts(self) -> dict:
        return {"pairs": self.pairs, "measured_pairs": self.m["pairs"], "pending": self.pending,
                "errors": len(self.errors), "requests_started": self.requests_started}

    async def error_list(self) -> list[str]:
        return self.errors[:3]

    async def pid(self) -> int:
        return os.getpid()

    async def start_measure(self, seconds: float | None) -> None:
        self.m = self._empty_samples()
        self.window[0], self.cpu_s[0] = time.perf_counter(), time.process_time()
        self.until = self.window[0] + seconds if seconds is not None else math.inf
        self.measuring = True

    async def stop_measure(self) -> dict:
        self.measuring = False
        self.window[1], self.cpu_s[1] = min(time.perf_counter(), self.until), time.process_time()
        out = dict(self.m)
        out["chunk_answers"] = dict(out["chunk_answers"])
        out["window_s"] = self.window[1] - self.window[0]
        out["cpu_s"] = self.cpu_s[1] - self.cpu_s[0]
        return out

    async def stop(self) -> None:
        self.stopping = True


def lane_period_s(a: argparse.Namespace) -> float | None:
    """A chunk's mean hold when paced: with fast calls, all lanes together then offer --offered-pairs-per-s."""
    return a.live / a.offered_pairs_per_s if a.offered_pairs_per_s else None


def start_servers(ray, replicas: int, actors: int) -> dict:
    """R server ids over `actors` actor processes (taken in turn): the router only stores and returns
    the handles, so what it does is the same however many processes stand behind them."""
    @ray.remote(num_cpus=0)
    class Server:
        def ping(self) -> str:
            return "ok"

    handles = [Server.remote() for _ in range(actors)]
    ray.get([h.ping.remote() for h in handles])  # all started before any router is timed
    return {f"127.0.0.1:{20000 + i}": handles[i % actors] for i in range(replicas)}


def write_router_yaml(directory: Path, policy: str, a: argparse.Namespace) -> Path:
    path = directory / f"router_{policy}.yaml"
    path.write_text(f"router_class: {OUR_CLASS}\npolicy: {policy}\nslots_per_replica: {a.slots}\n"
                    f"chunk_tokens: {a.chunk_tokens}\ndefault_max_tokens: {a.cap}\nseed: {a.seed}\n")
    return path


class FloorRouter:
    """Reference, not a router: our protocol's calls with no routing logic (the next server in turn, and
    the rest in one piece, like ours with verl_default). What it costs is Ray's call machinery alone:
    the same argument and result payloads as ours, on an actor of the same kind."""

    def __init__(self, servers: dict, config: dict | None = None) -> None:
        self.servers, self.ids, self.turn = dict(servers), list(servers), 0

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids", "sampling_params"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def _next(self) -> tuple[str, object, int]:
        self.turn += 1
        server_id = self.ids[self.turn % len(self.ids)]
        return server_id, self.servers[server_id], 0


class SyncFloorRouter(FloorRouter):
    def acquire_chunk(self, request_id: str, prompt_ids=None, sampling_params=None):
        return self._next()

    def release_server(self, server_id: str, request_id=None, generated_tokens=None, finished=None) -> None:
        pass


class AsyncFloorRouter(FloorRouter):
    async def acquire_chunk(self, request_id: str, prompt_ids=None, sampling_params=None):
        return self._next()

    async def release_server(self, server_id: str, request_id=None, generated_tokens=None, finished=None) -> None:
        pass


# Reference routers (not in the default list): floor_sync is a plain actor, like verl's router;
# floor_async an asyncio actor admitting as many calls as ours.
FLOORS = {"floor_sync": (SyncFloorRouter, {"max_concurrency": 1}),
          "floor_async": (AsyncFloorRouter, {"max_concurrency": 1_000_000})}


def start_router(name: str, servers: dict, a: argparse.Namespace, tmp: Path):
    from verl.workers.rollout.router import get_router_handle

    if name in FLOORS:
        import ray

        cls, options = FLOORS[name]
        return ray.remote(**options)(cls).remote(servers, {})
    if name == VERL_ROUTER:
        return get_router_handle(servers)
    return get_router_handle(servers, router_config_path=str(write_router_yaml(tmp, name[len(OUR_PREFIX):], a)))


# ---- one measured run -------------------------------------------------------------------------
def _say(text: str) -> None:
    print(f"[router_scale] {text}", flush=True)


class ProcessWatch:
    """CPU and RSS of a process read from the driver: a probe call would queue behind thousands of
    router calls (verl's router runs one call at a time) and skew the window."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak_rss = 0

    def cpu_s(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def rss(self) -> int:
        rss = self.proc.memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        return rss


def _gather(ray, refs: list, timeout_s: float | None):
    """Results of `refs`, or None if they are not all back in time: a swamped caller or router answers a
    probe only after its backlog, and a late answer must not stretch the measured window."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=None if timeout_s is None else max(0.0, timeout_s))
    return ray.get(refs) if len(ready) == len(refs) else None


def _wait_phase(ray, callers, label: str, done, a, deadline: float, watch: ProcessWatch, run_refs, parked,
                samples: dict | None = None, until: float | None = None) -> None:
    """Poll the callers with progress lines until `done(counts)`, or until the clock reads `until`
    (a timed window ends on time however late the probes come back)."""
    last_pairs, last_t, first = None, time.perf_counter(), True
    while True:
        pause_s = min(a.progress_s, 0.25) if first else a.progress_s
        first = False
        if until is not None:
            pause_s = min(pause_s, until - time.perf_counter())
        time.sleep(max(0.0, pause_s))
        if until is not None and time.perf_counter() >= until:
            return
        budget_s = None if until is None else until - time.perf_counter()
        counts = _gather(ray, [c.counts.remote() for c in callers], budget_s)
        if counts is None:
            continue
        counts = {k: sum(c[k] for c in counts) for k in counts[0]}
        now = time.perf_counter()
        parked_now = parked(None if until is None else until - now)
        rss = watch.rss()
        if samples is not None:
            samples["in_acquire"].append(counts["pending"])
            if parked_now is not None:
                samples["parked"].append(parked_now)
        rate = f"{(counts['pairs'] - last_pairs) / (now - last_t):.0f}" if last_pairs is not None else "-"
        last_pairs, last_t = counts["pairs"], now
        _say(f"{label}: {counts['pairs']} pairs ({counts['measured_pairs']} measured), {rate} pairs/s now, "
             f"{counts['pending']} in acquire ({parked_now if parked_now is not None else '?'} parked), "
             f"{counts['requests_started']} requests started, router RSS {rss / 2**20:.0f} MiB")
        if counts["errors"]:
            first_errors = [e for c in callers for e in ray.get(c.error_list.remote())][:3]
            raise RuntimeError(f"{counts['errors']} lane errors, first: {first_errors}")
        ended, _ = ray.wait(run_refs, timeout=0, num_returns=len(run_refs))
        if ended:
            raise RuntimeError(f"callers ended early: {ray.get(ended[0])}")
        if done(counts):
            return
        if now > deadline:
            raise TimeoutError(f"{label}: no progress to the goal within --timeout-s={a.timeout_s}")


def run_router(ray, name: str, servers: dict, workload: Workload, a: argparse.Namespace, tmp: Path,
               label: str) -> dict:
    Caller = ray.remote(num_cpus=0)(CallerImpl)
    t0 = time.perf_counter()
    deadline = t0 + a.timeout_s
    router = start_router(name, servers, a, tmp)
    probe = ray.get(router.__ray_call__.remote(_process_probe))
    watch = ProcessWatch(probe["pid"])
    out: dict = {"router": name, "router_pid": probe["pid"], "rss_start_mib": round(probe["rss_bytes"] / 2**20, 1)}
    callers = [Caller.remote(router, name != VERL_ROUTER, lanes_of(c, a.callers, a.live), workload,
                             a.chunk_tokens, a.fixed_chunks, a.hold_ms / 1e3, lane_period_s(a))
               for c in range(a.callers)]
    caller_watch = [ProcessWatch(pid) for pid in ray.get([c.pid.remote() for c in callers])]
    run_refs = [c.run.remote() for c in callers]

    def parked(timeout_s: float | None) -> int | None:
        # verl's router never parks an acquire, and runs one call at a time: a probe would only queue.
        if name == VERL_ROUTER or name in FLOORS:
            return 0
        got = _gather(ray, [router.__ray_call__.remote(_parked_probe)], timeout_s)
        return None if got is None else got[0]

    try:
        _wait_phase(ray, callers, f"{label} warm-up", lambda c: c["pairs"] >= a.warmup_pairs, a, deadline,
                    watch, run_refs, parked)
        # Each caller closes its own window after --seconds on its clock; the driver reads the CPU
        # counters at the same moment on its own clock (psutil, no Ray call in the way).
        ray.get([c.start_measure.remote(a.seconds) for c in callers])
        cpu0, caller_cpu0 = watch.cpu_s(), sum(w.cpu_s() for w in caller_watch)
        window0 = time.perf_counter()
        profiler = start_profile(a, name, label, probe["pid"])
        polled: dict = {"in_acquire": [], "parked": []}
        until = window0 + a.seconds if a.seconds is not None else None
        _wait_phase(ray, callers, f"{label} measure", lambda c: c["measured_pairs"] >= (a.pairs or math.inf), a,
                    deadline, watch, run_refs, parked, polled, until)
        out["router_cpu_s"] = round(watch.cpu_s() - cpu0, 3)
        out["callers_cpu_s"] = round(sum(w.cpu_s() for w in caller_watch) - caller_cpu0, 3)
        window_s = time.perf_counter() - window0
        samples = ray.get([c.stop_measure.remote() for c in callers])
        out["router_cpu_util"] = round(out["router_cpu_s"] / window_s, 3)
        out["callers_cpu_util"] = round(out["callers_cpu_s"] / window_s, 3)
        out["rss_end_mib"] = round(watch.rss() / 2**20, 1)
        # Anything else running on the host (another job's tests) takes CPU from the router and callers.
        out["host_load_1min"] = round(os.getloadavg()[0], 2)
        out["rss_peak_mib"] = round(watch.peak_rss / 2**20, 1)
        out["rss_end_probe_mib"] = round(ray.get(router.__ray_call__.remote(_process_probe))["rss_bytes"] / 2**20, 1)
        out.update(summarize(samples, window_s, polled, a))
        # Host-independent cost: the router process's CPU per pair. 1000 / this is what it could answer
        # with a whole core of this speed to itself. Calls, not pairs, are counted against the window's
        # CPU: in a closed loop acquires and releases come in waves that a window may cut unevenly.
        calls = out["acquires"] + out["pairs"]
        out["router_cpu_ms_per_pair"] = round(2e3 * out["router_cpu_s"] / max(1, calls), 3)
        out["router_capacity_pairs_per_s"] = round(1e3 / max(1e-9, out["router_cpu_ms_per_pair"]), 1)
        out["profile"] = finish_profile(profiler)
        ray.get([c.stop.remote() for c in callers])
        # Lanes stop at their next release; parked ones get the slots those releases free.
        ended, left = ray.wait(run_refs, num_returns=len(run_refs), timeout=max(30.0, deadline - time.perf_counter()))
        out["caller_errors"] = sum(r["error_count"] for r in ray.get(ended))
        out["callers_not_drained"] = len(left)
    finally:
        for actor in [*callers, router]:
            ray.kill(actor)
    out["run_s"] = round(time.perf_counter() - t0, 1)
    return out


class Direct:
    """A router object called the way its actor handle is (`router.method.remote(...)`), on the caller's
    event loop with no Ray in between: what the routing logic costs by itself. Each call first yields to
    the loop, as a remote call does, so that lanes whose answer is ready at once still take turns."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name: str):
        fn = getattr(self.obj, name)

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                return _direct_call(fn, args, kwargs)

        return _Method


async def _direct_call(fn, args, kwargs):
    await asyncio.sleep(0)
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def local_router(name: str, servers: dict, a: argparse.Namespace, tmp: Path):
    """The object each router's actor would hold, built with the same arguments verl gives it."""
    if name in FLOORS:
        return FLOORS[name][0](servers, {})
    if name == VERL_ROUTER:
        from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

        return GlobalRequestLoadBalancer(servers=servers, max_cache_size=DEFAULT_ROUTING_CACHE_SIZE)
    import yaml

    from rollout_ext.verl.router import TailAwareRouter

    config = yaml.safe_load(write_router_yaml(tmp, name[len(OUR_PREFIX):], a).read_text())
    return TailAwareRouter(servers, config)


async def run_router_in_process(name: str, workload: Workload, a: argparse.Namespace, tmp: Path, label: str) -> dict:
    """`run_router` without Ray: one CallerImpl holds every lane, on this process's loop with the router."""
    import psutil

    proc = psutil.Process()
    t0 = time.perf_counter()
    servers = {f"server-{i}": None for i in range(a.replicas)}
    obj = local_router(name, servers, a, tmp)
    out: dict = {"router": name, "router_pid": os.getpid(), "rss_start_mib": round(proc.memory_info().rss / 2**20, 1)}
    caller = CallerImpl(Direct(obj), name != VERL_ROUTER, list(range(a.live)), workload, a.chunk_tokens,
                        a.fixed_chunks, a.hold_ms / 1e3, lane_period_s(a))
    task = asyncio.ensure_future(caller.run())
    deadline = t0 + a.timeout_s
    polled: dict = {"in_acquire": [], "parked": []}
    peak_rss = 0

    async def wait(phase: str, done, until: float | None = None, samples: dict | None = None) -> None:
        nonlocal peak_rss
        last, last_t, next_say = caller.pairs, time.perf_counter(), time.perf_counter() + a.progress_s
        while not done():
            await asyncio.sleep(0.05 if until is None else max(0.0, min(0.05, until - time.perf_counter())))
            now = time.perf_counter()
            if until is not None and now >= until:
                return
            if task.done():
                raise RuntimeError(f"lanes ended early: {task.result()}")
            if caller.errors:
                raise RuntimeError(f"{len(caller.errors)} lane errors, first: {caller.errors[:3]}")
            if now > deadline:
                raise TimeoutError(f"{label} {phase}: no progress to the goal within --timeout-s={a.timeout_s}")
            if samples is not None:
                samples["in_acquire"].append(caller.pending)
                samples["parked"].append(_parked_probe(obj))
            if now >= next_say:
                rss = proc.memory_info().rss
                peak_rss = max(peak_rss, rss)
                _say(f"{label} {phase}: {caller.pairs} pairs ({caller.m['pairs']} measured), "
                     f"{(caller.pairs - last) / (now - last_t):.0f} pairs/s now, {caller.pending} in acquire "
                     f"({_parked_probe(obj)} parked), {caller.requests_started} requests started, "
                     f"RSS {rss / 2**20:.0f} MiB")
                last, last_t, next_say = caller.pairs, now, now + a.progress_s

    try:
        await wait("warm-up", lambda: caller.pairs >= a.warmup_pairs)
        await caller.start_measure(a.seconds)
        cpu0, window0 = time.process_time(), time.perf_counter()
        until = window0 + a.seconds if a.seconds is not None else None
        await wait("measure", lambda: caller.m["pairs"] >= (a.pairs or math.inf), until, polled)
        samples = [await caller.stop_measure()]
        window_s = time.perf_counter() - window0
        out["router_cpu_s"] = round(time.process_time() - cpu0, 3)
        out["callers_cpu_s"] = 0.0  # the lanes run in the router's process: its CPU above includes theirs
        out["router_cpu_util"] = round(out["router_cpu_s"] / window_s, 3)
        out["callers_cpu_util"] = 0.0
        out["rss_end_mib"] = round(proc.memory_info().rss / 2**20, 1)
        out["rss_peak_mib"] = round(max(peak_rss, proc.memory_info().rss) / 2**20, 1)
        out["host_load_1min"] = round(os.getloadavg()[0], 2)
        out.update(summarize(samples, window_s, polled, a))
        calls = out["acquires"] + out["pairs"]
        out["router_cpu_ms_per_pair"] = round(2e3 * out["router_cpu_s"] / max(1, calls), 3)
        out["router_capacity_pairs_per_s"] = round(1e3 / max(1e-9, out["router_cpu_ms_per_pair"]), 1)
        out["profile"] = None
        await caller.stop()
        result = await asyncio.wait_for(task, timeout=max(30.0, deadline - time.perf_counter()))
        out["caller_errors"] = result["error_count"]
        out["callers_not_drained"] = 0
    finally:
        if not task.done():
            task.cancel()
    out["run_s"] = round(time.perf_counter() - t0, 1)
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return round(float(np.percentile(values, q)), 3)


def summarize(samples: list[dict], window_s: float, polled: dict, a: argparse.Namespace) -> dict:
    first = [x for s in samples for x in s["acquire_first_ms"]]
    nxt = [x for s in samples for x in s["acquire_next_ms"]]
    release = [x for s in samples for x in s["release_ms"]]
    pairs = sum(s["pairs"] for s in samples)
    # Every caller's own window; they open and close within a poll of each other.
    caller_window_s = statistics.median(s["window_s"] for s in samples)
    answers = Counter()
    for s in samples:
        answers.update(s["chunk_answers"])
    mean_parked = statistics.fmean(polled["parked"]) if polled["parked"] else 0.0
    return {
        "pairs": pairs,
        "acquires": len(first) + len(nxt),
        "window_s": round(caller_window_s, 3),
        "pairs_per_s": round(pairs / caller_window_s, 1),
        "requests_finished": sum(s["requests_finished"] for s in samples),
        # Pairs per request differ by router (verl's is cut at every --chunk-tokens, ours runs the rest in
        # one piece where it answers 0): requests/s compares the work served.
        "requests_per_s": round(sum(s["requests_finished"] for s in samples) / caller_window_s, 1),
        "first_acquire_share": round(len(first) / max(1, pairs), 4),
        "rest_in_one_piece_share": round(answers.get("rest", 0) / max(1, pairs), 4),
        "acquire_p50_ms": _pct(first + nxt, 50), "acquire_p99_ms": _pct(first + nxt, 99),
        "acquire_first_p99_ms": _pct(first, 99), "acquire_next_p99_ms": _pct(nxt, 99),
        "release_p50_ms": _pct(release, 50), "release_p99_ms": _pct(release, 99),
        # Lanes inside an acquire call: queued at the router, or parked by its policy for a slot.
        "mean_in_acquire": round(statistics.fmean(polled["in_acquire"]), 1) if polled["in_acquire"] else 0.0,
        "mean_parked": round(mean_parked, 1),
        "waiting_regime": mean_parked > WAITING_SHARE * a.live,
        "offered_pairs_per_s": a.offered_pairs_per_s,
        "driver_window_s": round(window_s, 3),
    }


def verdict(run: dict) -> str:
    """The target, read the way the run allows: a closed loop measures throughput only (every lane calls
    again at once, so its latency is queueing: live / throughput); a paced run must keep up with what
    it offers (>= the target) with both p99s under the target."""
    if run.get("error"):
        return "error"
    if run["waiting_regime"]:
        return f"n/a ({run['mean_parked']:.0f} parked for slots: acquire latency is queueing)"
    misses = []
    if run["pairs_per_s"] < TARGET_PAIRS_PER_S * (KEEP_UP_SHARE if run.get("offered_pairs_per_s") else 1.0):
        misses.append(f"{run['pairs_per_s']:.0f} pairs/s")
    offered = run.get("offered_pairs_per_s")
    if not offered:
        return ("yes" if not misses else f"no ({misses[0]})") + ", throughput only (closed loop)"
    if offered < TARGET_PAIRS_PER_S:
        misses.append(f"offered {offered:.0f} pairs/s only")
    elif run["pairs_per_s"] < KEEP_UP_SHARE * offered and not misses:
        misses.append(f"kept up with {run['pairs_per_s'] / offered:.0%} of the offered load")
    slow = [f"{key[:-7]} p99 {run[key]:.1f} ms" for key in ("acquire_p99_ms", "release_p99_ms")
            if run[key] >= TARGET_P99_MS]
    if not misses and not slow:
        return "yes"
    # Say whether latency held even where the load fell short: at a lower load that is half the answer.
    return f"no ({', '.join(misses + slow)})" + ("" if slow else f"; both p99 < {TARGET_P99_MS:.0f} ms")


# ---- profile ----------------------------------------------------------------------------------
def start_profile(a: argparse.Namespace, name: str, label: str, pid: int):
    if not a.profile_dir:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        _say("py-spy not found: no profile (pip install py-spy)")
        return None
    out_dir = Path(a.profile_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{label.replace(' ', '_').replace('/', '-')}.txt"
    # --pairs mode has no known length: sample for the timeout and stop it at the window's end.
    duration_s = math.ceil(a.seconds) if a.seconds is not None else math.ceil(a.timeout_s)
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", "200",
                             "--format", "raw", "--nonblocking", "--output", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, path


def finish_profile(profiler) -> dict | None:
    if profiler is None:
        return None
    proc, path = profiler
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(2)  # py-spy writes what it has on SIGINT
        proc.wait(timeout=30)
    if not path.exists():
        return {"error": (proc.stdout.read() if proc.stdout else "")[-500:]}
    return summarize_stacks(path.read_text())


# Frames of the routers' own Python (policy and protocol); every other frame is Ray's call machinery
# (task execution, (de)serialization, the asyncio plumbing of an async actor) or the interpreter.
ROUTER_CODE = ("rollout_ext/", "verl/workers/rollout/router.py")


def summarize_stacks(text: str, top: int = 15) -> dict:
    """Collapsed stacks -> the functions with the largest share of the samples (self and inclusive), the
    share with a router-code frame on the stack, and the router-code functions by inclusive share."""
    own, inclusive, code, total, in_code = Counter(), Counter(), Counter(), 0, 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        # "func (file.py:123)" -> "func (file.py)": one function, whatever line it was on.
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f for f in stack.split(";")]
        own[frames[-1]] += n
        ours = {f for f in frames if any(part in f for part in ROUTER_CODE)}
        in_code += n if ours else 0
        for frame in set(frames):
            inclusive[frame] += n
        for frame in ours:
            code[frame] += n

    def share(c: Counter) -> list:
        return [[f, round(n / max(1, total), 4)] for f, n in c.most_common(top)]

    return {"samples": total, "router_code_share": round(in_code / max(1, total), 4), "self": share(own),
            "inclusive": share(inclusive), "router_code": share(code)}


# ---- the whole bench --------------------------------------------------------------------------
def aggregate(runs: list[dict]) -> dict:
    """Median over repeats, and the spread (max - min), of the headline numbers."""
    ok = [r for r in runs if not r.get("error")]
    out = {"repeats": len(runs), "failed": len(runs) - len(ok)}
    keys = ("pairs_per_s", "requests_per_s", "acquire_p50_ms", "acquire_p99_ms", "release_p50_ms", "release_p99_ms",
            "rss_start_mib", "rss_end_mib", "router_cpu_util", "callers_cpu_util", "mean_in_acquire",
            "mean_parked", "router_cpu_ms_per_pair", "router_capacity_pairs_per_s")
    for key in keys:
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 3)
            out[key + "_spread"] = round(max(values) - min(values), 3)
    if ok:
        out["waiting_regime"] = any(r["waiting_regime"] for r in ok)
        out["offered_pairs_per_s"] = ok[0]["offered_pairs_per_s"]
        out["meets_target"] = verdict({**out, "error": None}) if "pairs_per_s" in out else "error"
    else:
        out["meets_target"] = "error"
    return out


def source_fingerprint() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    files = []
    for entry in ROUTER_SOURCES:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for path in files:
        if path.exists():
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return {"git_head": git("rev-parse", "HEAD"),
            "router_sources_dirty": git("status", "--porcelain", "--", *ROUTER_SOURCES).splitlines(),
            "router_sources_sha256": digest.hexdigest()[:16]}


def setup_info(a: argparse.Namespace) -> dict:
    import ray
    import verl

    return {"python": platform.python_version(), "ray": ray.__version__, "verl": getattr(verl, "__version__", "?"),
            "host_cpus": os.cpu_count(), "platform": platform.platform(), **source_fingerprint()}


def load_text(a: argparse.Namespace) -> str:
    if a.offered_pairs_per_s:
        return (f"paced at {a.offered_pairs_per_s:.0f} pairs/s offered "
                f"(a chunk holds {lane_period_s(a):.2f} s on average)")
    return f"closed loop, hold {a.hold_ms} ms"


def table(results: dict, a: argparse.Namespace) -> str:
    head = ("| router | pairs/s | requests/s | acquire p50 / p99 ms | release p50 / p99 ms "
            "| router RSS start -> end MiB | router CPU (ms/pair) | callers CPU | in acquire (parked) | target |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results.items():
        s = res["summary"]
        if "pairs_per_s" not in s:
            lines.append(f"| {name} | error | | | | | | | | error |")
            continue
        spread = f" ±{s['pairs_per_s_spread'] / 2:.0f}" if s["repeats"] > 1 else ""
        cells = [name, f"{s['pairs_per_s']:.0f}{spread}", f"{s['requests_per_s']:.0f}",
                 f"{s['acquire_p50_ms']:.2f} / {s['acquire_p99_ms']:.2f}",
                 f"{s['release_p50_ms']:.2f} / {s['release_p99_ms']:.2f}",
                 f"{s['rss_start_mib']:.0f} -> {s['rss_end_mib']:.0f}",
                 f"{s['router_cpu_util']:.2f} ({s['router_cpu_ms_per_pair']:.2f})", f"{s['callers_cpu_util']:.2f}",
                 f"{s['mean_in_acquire']:.0f} ({s['mean_parked']:.0f})", s["meets_target"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "pairs_per_s" in r["summary"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [results[n]["summary"]["pairs_per_s"] for n in names], color="tab:blue")
    left.axhline(TARGET_PAIRS_PER_S, color="red", ls="--", label=f"target {TARGET_PAIRS_PER_S:.0f}")
    left.set_ylabel("acquire+release pairs / s")
    left.legend()
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [results[n]["summary"]["acquire_p99_ms"] for n in names], 0.4, label="acquire p99")
    right.bar([i + 0.2 for i in x], [results[n]["summary"]["release_p99_ms"] for n in names], 0.4, label="release p99")
    right.axhline(TARGET_P99_MS, color="red", ls="--", label=f"target {TARGET_P99_MS:.0f} ms")
    right.set_xticks(list(x), names)
    right.set_ylabel("ms")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"router actor: {a.live} live requests, {a.replicas} replicas, {a.callers} callers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    # Ray workers (router, callers) import rollout_ext from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    import ray

    setup = setup_info(a)
    dirty = " (uncommitted changes)" if setup["router_sources_dirty"] else ""
    _say(f"git HEAD {setup['git_head'][:12]}, router sources {setup['router_sources_sha256']}{dirty}; "
         f"ray {setup['ray']}, verl {setup['verl']}")
    workload = make_workload(a)
    if not a.in_process:
        ray.init(address="local", include_dashboard=False, num_cpus=a.num_cpus or os.cpu_count(), log_to_driver=False)
    results: dict = {name: {"runs": []} for name in a.router_list}
    try:
        if not a.in_process:
            t = time.perf_counter()
            servers = start_servers(ray, a.replicas, a.server_actors)
            _say(f"{a.replicas} servers on {a.server_actors} actors up in {time.perf_counter() - t:.1f} s")
        with tempfile.TemporaryDirectory(prefix="router_scale_") as tmp:
            for rep in range(a.repeats):
                for name in a.router_list:  # interleaved, so drift over time hits every router alike
                    label = f"{name} {rep + 1}/{a.repeats}"
                    try:
                        if a.in_process:
                            run = asyncio.run(run_router_in_process(name, workload, a, Path(tmp), label))
                        else:
                            run = run_router(ray, name, servers, workload, a, Path(tmp), label)
                    except Exception as e:  # noqa: BLE001 - record it, run the other routers
                        run = {"router": name, "error": f"{type(e).__name__}: {e}"[:1000]}
                    run.update(live=a.live, replicas=a.replicas)
                    results[name]["runs"].append(run)
                    _say(f"{label}: " + (run["error"] if run.get("error") else
                         f"{run['pairs_per_s']:.0f} pairs/s, acquire p99 {run['acquire_p99_ms']} ms, "
                         f"release p99 {run['release_p99_ms']} ms, router CPU {run['router_cpu_util']:.2f}, "
                         f"RSS {run['rss_start_mib']} -> {run['rss_end_mib']} MiB"))
    finally:
        if not a.in_process:
            ray.shutdown()
    for res in results.values():
        res["summary"] = aggregate(res["runs"])
    print()
    where = "in process, no Ray (router CPU includes the lanes')" if a.in_process else f"callers {a.callers}"
    print(f"live {a.live}, replicas {a.replicas}, slots {a.slots}, {where}, chunk {a.chunk_tokens}, "
          f"{load_text(a)}, repeats {a.repeats} (median{', ± half the spread' if a.repeats > 1 else ''}); "
          f"host {setup['host_cpus']} CPUs")
    print(table(results, a))
    at_size = (a.live, a.replicas) == TARGET_SIZE
    print(f"target{'' if at_size else ' (stated for 10,000 live on 128 replicas; this run is another size)'}: "
          f">= {TARGET_PAIRS_PER_S:.0f} pairs/s and p99 < {TARGET_P99_MS:.0f} ms for acquire and release")
    for name, res in results.items():
        print(f"  {name}: {res['summary']['meets_target']}")
        profile = next((r.get("profile") for r in res["runs"] if r.get("profile")), None)
        if profile and profile.get("self"):
            print(f"    py-spy, {profile['samples']} samples, {100 * profile['router_code_share']:.0f}% in router "
                  "code; self: " +
                  ", ".join(f"{f} {100 * s:.1f}%" for f, s in profile["self"][:8]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        args = {k: v for k, v in vars(a).items() if k != "router_list"}
        workload_info = {k: v for k, v in asdict(workload).items() if k not in ("prompts", "prompt_effects")}
        workload_info["prompt_tokens_mean"] = round(statistics.fmean(len(p) for p in workload.prompts), 1)
        Path(a.json).write_text(json.dumps({"args": args, "setup": setup, "workload": workload_info,
                                            "target": {"pairs_per_s": TARGET_PAIRS_PER_S, "p99_ms": TARGET_P99_MS,
                                                       "live": TARGET_SIZE[0], "replicas": TARGET_SIZE[1]},
                                            "routers": results}, indent=1))
        _say(f"wrote {a.json}")
    if a.plot:
        plot(results, a.plot, a)
        _say(f"wrote {a.plot}")
    failed = any(r.get("error") or r.get("caller_errors") for res in results.values() for r in res["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
