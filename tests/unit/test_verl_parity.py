"""Where verl branches on rollout.name == "vllm", rollout_ext behaves like vllm (real verl, no mocks).

Each parity test also reverts the patch and checks that the behaviour then differs, so a test that
passes proves the patch is what makes rollout_ext behave like vllm.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import pytest

import verl  # noqa: E402,F401

import rollout_ext.verl  # noqa: E402,F401  (registers, in case entry-point plugins are off)
from rollout_ext import patches  # noqa: E402
from rollout_ext.patches._verl import VerlPatchError, check_target  # noqa: E402


@contextmanager
def reverted(name: str):
    """Patch `name` undone inside. Its verl target is imported first: a verl-side patch is applied
    when verl imports that module, so reverting before the import would undo nothing."""
    importlib.import_module(patches.PATCHES[name].target)
    patch = patches.load(name)
    patch.revert()
    try:
        yield
    finally:
        patch.apply()


def rollout_config(name: str, **fields):
    from verl.workers.config.rollout import RolloutConfig

    return RolloutConfig(name=name, **fields)


def test_backend_resolves_through_both_registries():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    from rollout_ext.verl.replica import RolloutExtPDReplica, RolloutExtReplica

    assert get_rollout_replica_class("rollout_ext") is RolloutExtReplica
    assert issubclass(RolloutExtReplica, vLLMReplica)
    assert get_rollout_replica_class("rollout_ext", disaggregation_enabled=True) is RolloutExtPDReplica
    assert get_rollout_class("rollout_ext", "async") is get_rollout_class("vllm", "async")


@pytest.mark.parametrize("name", ["vllm", "rollout_ext"])
def test_pipeline_parallel_rejected_like_vllm(name):
    with pytest.raises(NotImplementedError, match="pipeline_model_parallel_size"):
        rollout_config(name, pipeline_model_parallel_size=2)


def test_pipeline_parallel_check_comes_from_the_patch():
    with reverted("verl_rollout_config_checks"):
        rollout_config("rollout_ext", pipeline_model_parallel_size=2)  # verl alone lets it through


@pytest.mark.parametrize("name", ["vllm", "rollout_ext"])
def test_pd_disaggregation_accepted_like_vllm(name):
    cfg = rollout_config(name, disaggregation={"enabled": True})
    assert cfg.disaggregation.enabled and cfg.name == name


def test_pd_disaggregation_rejected_without_the_patch():
    with reverted("verl_rollout_config_checks"), pytest.raises(ValueError, match="disaggregation"):
        rollout_config("rollout_ext", disaggregation={"enabled": True})


def test_priority_client_sees_vllm_and_leaves_the_trainer_config_alone():
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "rollout_ext", "full_determinism": False}}})
    OmegaConf.set_struct(config, True)
    client = LLMServerClient(config, load_balancer_handle=None)
    assert client.config.actor_rollout_ref.rollout.name == "vllm"
    assert config.actor_rollout_ref.rollout.name == "rollout_ext"
    with reverted("verl_client_priority"):
        assert LLMServerClient(config).config.actor_rollout_ref.rollout.name == "rollout_ext"


def test_patches_apply_idempotently_and_revert_cleanly():
    from verl.workers.config.rollout import RolloutConfig

    patch = patches.load("verl_rollout_config_checks")
    patched = RolloutConfig.__post_init__
    patch.apply()
    assert RolloutConfig.__post_init__ is patched
    patch.revert()
    assert not hasattr(RolloutConfig.__post_init__, "__wrapped__")
    patch.revert()
    patch.apply()
    assert RolloutConfig.__post_init__.__wrapped__ is not None


def test_guard_trips_on_a_changed_signature():
    def validate_config(cfg, use_reference_policy):  # first parameter renamed
        return None

    with pytest.raises(VerlPatchError, match="lora_rank_check"):
        check_target("lora_rank_check", validate_config, ("config",))


def test_engine_kwargs_rollout_ext_over_vllm():
    from rollout_ext.verl.replica import merged_engine_kwargs

    merged = merged_engine_kwargs({"vllm": {"max_logprobs": 20, "seed": 1}, "rollout_ext": {"seed": 2}})
    assert merged == {"max_logprobs": 20, "seed": 2}
    assert merged_engine_kwargs({"vllm": {"swap_space": 0}}) == {"swap_space": 0}
    assert merged_engine_kwargs(None) == {}


def ppo_config(*overrides: str):
    import os

    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = [
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[*base, *overrides])


def test_lora_rank_checked_like_vllm():
    import verl.utils.config as verl_config

    cfg = ppo_config("actor_rollout_ref.rollout.name=rollout_ext", "actor_rollout_ref.model.lora_rank=1024")
    with pytest.raises(ValueError, match="lora_rank must be less than or equal to"):
        verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)
    assert cfg.actor_rollout_ref.rollout.name == "rollout_ext"
    patches.load("verl_lora_rank_check").revert()
    try:
        verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)  # verl alone passes it
    finally:
        patches.load("verl_lora_rank_check").apply()


def test_unset_rollout_name_gets_verls_own_error():
    import verl.utils.config as verl_config

    def error_of(cfg):
        try:
            verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)
        except Exception as e:  # whatever verl raises, compared with and without the patch
            return type(e), str(e)
        return None

    cfg = ppo_config("actor_rollout_ref.rollout.name=???")
    patched = error_of(cfg)
    patches.load("verl_lora_rank_check").revert()
    try:
        alone = error_of(cfg)  # verl without any parity patch
    finally:
        patches.load("verl_lora_rank_check").apply()
    # validate_config itself does not read the name, so verl alone passes; the parity wrapper must
    # not raise omegaconf's MissingMandatoryValue from rollout_ext's frame before verl's own check.
    assert patched == alone
