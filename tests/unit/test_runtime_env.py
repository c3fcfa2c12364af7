"""Ray runtime_env presets: content, validity, and YAML that Ray accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from packaging.version import Version

from rollout_ext.config import ConfigError, ExtConfig
from rollout_ext.runtime_env import PRESETS, preset_env, to_yaml


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config_and_loads_as_yaml(name):
    env = preset_env(name, Version("0.27.1"))
    ExtConfig.from_env(env)
    loaded = yaml.safe_load(to_yaml(name, env))
    assert loaded == {"env_vars": env}
    assert all(isinstance(v, str) for v in loaded["env_vars"].values())


def test_tp8_has_mc2_and_no_aiv_tp4_the_reverse():
    tp8, tp4 = preset_env("dapo-a2-tp8"), preset_env("dapo-a2-tp4")
    assert tp8["ROLLOUT_EXT_MC2"] == "1" and "HCCL_OP_EXPANSION_MODE" not in tp8
    assert tp4["ROLLOUT_EXT_MC2"] == "0" and tp4["HCCL_OP_EXPANSION_MODE"] == "AIV"
    for env in (tp8, tp4):
        assert env["VLLM_PLUGINS"] == "rollout_ext" and env["TASK_QUEUE_ENABLE"] == "2"


def test_use_v1_only_where_vllm_reads_it():
    assert "VLLM_USE_V1" not in preset_env("dapo-a2-tp8", Version("0.27.1"))
    assert preset_env("dapo-a2-tp8", Version("0.10.1"))["VLLM_USE_V1"] == "1"


def test_unknown_preset_and_conflicting_override():
    with pytest.raises(ValueError, match="--preset 'tp3'.*dapo-a2-tp4"):
        preset_env("tp3")
    with pytest.raises(ConfigError, match="ROLLOUT_EXT_FLASHCOMM"):
        preset_env("dapo-a2-tp8", overrides={"ROLLOUT_EXT_FLASHCOMM": "1"})


def test_cli_prints_yaml_ray_job_submit_accepts():
    proc = subprocess.run([sys.executable, "-m", "rollout_ext", "env", "--preset", "dapo-a2-tp8"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM_PLUGINS: rollout_ext" in proc.stdout
    # Ray's own loader for `ray job submit --runtime-env FILE`.
    from ray.runtime_env import RuntimeEnv

    runtime_env = RuntimeEnv(**yaml.safe_load(proc.stdout))
    assert runtime_env["env_vars"]["ROLLOUT_EXT_MC2"] == "1"
