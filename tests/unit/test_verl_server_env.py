"""The env each rollout_ext server actor gets (pure Python; no Ray or vLLM)."""

from __future__ import annotations

import pytest

from rollout_ext.config import ConfigError
from rollout_ext.verl.server_env import cpu_thread_bind, plugin_list, server_env_vars


def test_plugin_list_adds_once_and_keeps_others():
    assert plugin_list(None) == "rollout_ext"
    assert plugin_list("lora_filesystem_resolver") == "lora_filesystem_resolver,rollout_ext"
    assert plugin_list("rollout_ext, x") == "rollout_ext,x"


def test_thread_bind_gives_each_tp_rank_a_core_and_replicas_disjoint_cores():
    assert cpu_thread_bind(0, 2, [0, 1]) == "0|1"
    assert [cpu_thread_bind(r, 1, [0, 1]) for r in range(2)] == ["0", "1"]
    assert cpu_thread_bind(1, 2, [4, 5, 6, 7]) == "6|7"
    assert cpu_thread_bind(1, 2, [0, 1]) == "0|1"  # more ranks than cores: wrap around


def test_server_env_carries_the_driver_config():
    env = server_env_vars(1, 1, "cpu", {"ROLLOUT_EXT_ROPE_CACHE": "0", "TASK_QUEUE_ENABLE": "1"})
    assert env["VLLM_PLUGINS"] == "rollout_ext"
    assert env["ROLLOUT_EXT_ROPE_CACHE"] == "0" and env["TASK_QUEUE_ENABLE"] == "1"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_CPU_OMP_THREADS_BIND"]


def test_server_env_respects_user_binding_and_has_no_cpu_settings_on_npu():
    env = server_env_vars(0, 2, "cpu", {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    npu = server_env_vars(0, 8, "npu", {"ROLLOUT_EXT_MC2": "1"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in npu and npu["ROLLOUT_EXT_MC2"] == "1"


def test_server_env_rejects_a_conflicting_driver_config():
    with pytest.raises(ConfigError):
        server_env_vars(0, 1, "npu", {"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FLASHCOMM": "1"})
