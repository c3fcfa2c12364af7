"""rollout_ext's replica and server: verl's vLLM ones, with the plugin env and our engine-kwargs key.

- `RolloutExtHttpServer` reads engine kwargs from `engine_kwargs.rollout_ext` over
  `engine_kwargs.vllm` (per key, ours win); on CPU it turns sleep mode off and gives the engine a
  fixed KV-cache budget, without which vLLM's CPU platform refuses to start.
- `RolloutExtReplica` / `RolloutExtPDReplica` start those servers with server_env_vars() added to
  each actor's runtime_env, and name the actors `rollout_ext_server_*`, which is where verl's
  ServerAdapter looks for them (vllm_rollout.py:321-323 uses rollout.name + '_').
Importing this module imports vLLM; only the registry loader does it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import ray
from verl.workers.rollout.replica import RolloutMode
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
from verl.workers.rollout.vllm_rollout.vllm_pd_replica import vLLMPDReplica

from rollout_ext.platform import device_type
from rollout_ext.verl.names import BACKEND, VLLM_BACKEND
from rollout_ext.verl.server_env import CPU_KV_CACHE_BYTES, server_env_vars

logger = logging.getLogger("rollout_ext")


def merged_engine_kwargs(engine_kwargs: Mapping | None) -> dict:
    """engine_kwargs.vllm overlaid with engine_kwargs.rollout_ext, so vLLM-tuned configs carry over."""
    engine_kwargs = engine_kwargs or {}
    return {**dict(engine_kwargs.get(VLLM_BACKEND) or {}), **dict(engine_kwargs.get(BACKEND) or {})}


class RolloutExtHttpServer(vLLMHttpServer):
    def _init_config(self, config):
        config = super()._init_config(config)
        if device_type() == "cpu" and config.enable_sleep_mode:
            # vLLM's CPU platform has no sleep mode and refuses to start with it on.
            logger.warning("rollout_ext: enable_sleep_mode=False on CPU (vLLM's CPU platform has no sleep mode)")
            config = dataclasses.replace(config, enable_sleep_mode=False)
        config.engine_kwargs = {**(config.engine_kwargs or {}), BACKEND: merged_engine_kwargs(config.engine_kwargs)}
        return config

    async def submission_open(self) -> bool:
        """False between verl's abort_all_requests and resume_generation: the router places nothing then."""
        return not self._submission_paused

    def _get_engine_kwargs_key(self) -> str:
        return BACKEND

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        if device_type() == "cpu":
            engine_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)


class _ActorClassWithEnv:
    """A Ray actor class whose .options() adds our env_vars under whatever runtime_env verl passes."""

    def __init__(self, actor_class, env_vars: dict[str, str]):
        self._actor_class = actor_class
        self.env_vars = dict(env_vars)

    def options(self, **options):
        runtime_env = dict(options.get("runtime_env") or {})
        # verl's own variables (device visibility, NCCL, PD ports) win over ours on a clash.
        runtime_env["env_vars"] = {**self.env_vars, **(runtime_env.get("env_vars") or {})}
        return self._actor_class.options(**{**options, "runtime_env": runtime_env})

    def remote(self, *args, **kwargs):
        return self.options().remote(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._actor_class, name)


def _server_class(replica) -> _ActorClassWithEnv:
    env = server_env_vars(replica.replica_rank, replica.world_size, device_type())
    if replica.rollout_mode in (RolloutMode.HYBRID, RolloutMode.COLOCATED):
        # The trainer syncs weights into these servers (patches/cpu_weight_reload.py needs to know).
        env["ROLLOUT_EXT_WEIGHT_SYNC"] = "1"
    return _ActorClassWithEnv(ray.remote(RolloutExtHttpServer), env)


class _WithPluginEnv:
    """Servers start with the plugin env; built at launch, once verl has set the rollout mode."""

    async def launch_servers(self):
        self.server_class = _server_class(self)
        return await super().launch_servers()

    def _get_server_name_prefix(self) -> str:
        return f"{BACKEND}_"


class RolloutExtReplica(_WithPluginEnv, vLLMReplica):
    pass


class RolloutExtPDReplica(_WithPluginEnv, vLLMPDReplica):
    pass
