"""The environment every rollout_ext server actor starts with (pure Python; no Ray, no vLLM).

A replica's vLLM engine core and workers are child processes of its server actor, so what the
actor's runtime_env carries reaches all of them: the plugin switch (VLLM_PLUGINS), the driver's
ROLLOUT_EXT_* config, and on CPU the settings without which a replica cannot start.
"""

from __future__ import annotations

import os

from rollout_ext.config import ExtConfig, environ_copy
from rollout_ext.verl.names import BACKEND

# On CPU, vLLM sizes the KV cache from gpu_memory_utilization of host RAM, which fails on a shared
# machine; a fixed budget is enough for rollout tests and small examples.
CPU_KV_CACHE_BYTES = 256 << 20


def plugin_list(current: str | None) -> str:
    """VLLM_PLUGINS with rollout_ext added; an empty or unset value means "all" and stays all."""
    if not current:
        return BACKEND
    names = [name.strip() for name in current.split(",") if name.strip()]
    return ",".join(names if BACKEND in names else [*names, BACKEND])


def cpu_thread_bind(replica_rank: int, world_size: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one replica: one core per TP rank, replicas on disjoint cores.

    vLLM's CPU worker binds rank i to the i-th '|'-separated group, so TP=2 needs two groups
    ('0|1'). When replicas x ranks exceed the cores, ranks wrap around and share cores.
    """
    first = replica_rank * world_size
    return "|".join(str(cores[(first + rank) % len(cores)]) for rank in range(world_size))


def server_env_vars(replica_rank: int, world_size: int, device: str, driver_env: dict[str, str] | None = None) -> dict:
    """env_vars for one server actor; `driver_env` defaults to this (the driver's) process env."""
    env = environ_copy() if driver_env is None else driver_env
    out = {"VLLM_PLUGINS": plugin_list(env.get("VLLM_PLUGINS"))}
    out.update(ExtConfig.from_env(env).to_env())
    if device == "cpu":
        # Ray actors are threaded; forking one for vLLM's engine core can deadlock.
        out["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        cores = sorted(os.sched_getaffinity(0))
        out["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_thread_bind(
            replica_rank, world_size, cores
        )
    return out
