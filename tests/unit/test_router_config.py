"""Router YAML parsing, policy construction, and the chunked-client selection patch (no Ray, no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollout_ext.verl.router import POLICY_NAMES, RouterConfig, prompt_hash

REPO = Path(__file__).resolve().parents[2]


def test_example_yaml_builds_the_tail_aware_policy():
    raw = yaml.safe_load((REPO / "examples" / "router_tail_aware.yaml").read_text())
    assert raw["router_class"] == "rollout_ext.verl.router.TailAwareRouterActor"
    config = RouterConfig.from_yaml_dict(raw)
    policy = config.make_policy()
    assert policy.name == "tail_aware" and policy.slots_per_replica == config.slots_per_replica


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_name_builds(name):
    assert RouterConfig(policy=name, slots_per_replica=4).make_policy().name == name


@pytest.mark.parametrize("raw, message", [
    ({"policy": "oracle_lpt"}, "allowed"),  # needs true lengths: simulator only
    ({"chunk_size": 64}, "unknown keys"),
    ({"chunk_tokens": -1}, "chunk_tokens"),
    ({"tail_aware": {"placement": "finish"}}, r"tail_aware: unknown fields \['placement'\]; allowed: .*move_margin"),
    ({"step_model": {"base_s": 0.01}}, r"step_model: unknown fields \['base_s'\]"),
    ({"tail_aware": {"move_margin": -1}}, "move_margin"),
    # The plain class would start with Ray's default concurrency and stall past 1,000 waiting requests.
    ({"router_class": "rollout_ext.verl.router.TailAwareRouter"}, r"allowed: rollout_ext.verl.router.TailAwareRouterActor"),
])
def test_bad_router_config_is_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig.from_yaml_dict(raw).make_policy()


def test_prompt_hash_is_stable_and_content_based():
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3))
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])


def _manager(name: str):
    from verl.workers.rollout.llm_server import LLMServerManager

    from rollout_ext.verl.tiny_run import compose

    config = compose([f"actor_rollout_ref.rollout.name={name}"])
    # A real manager object without replicas: get_client only reads these three attributes.
    manager = LLMServerManager.__new__(LLMServerManager)
    manager.config, manager.rollout_config, manager.global_load_balancer = (
        config, config.actor_rollout_ref.rollout, None)
    return manager


def test_apply_selects_the_chunked_client_for_rollout_ext_only():
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient, LLMServerManager

    from rollout_ext import patches
    from rollout_ext.verl import continuation

    selection = patches.load("verl_chunked_client")
    # verl's entry point registered rollout_ext, which applied this when verl imported llm_server.
    assert hasattr(LLMServerManager.get_client, "__wrapped__")
    selection.revert()
    original = LLMServerManager.get_client
    assert type(_manager("rollout_ext").get_client()) is LLMServerClient
    selection.apply()
    selection.apply()  # idempotent
    try:
        ours, theirs = _manager("rollout_ext"), _manager("vllm")
        assert type(ours.get_client()) is continuation.ChunkedLLMServerClient
        assert type(theirs.get_client()) is LLMServerClient
        # verl's abort-resuming client is replaced too (our client is one), with its only_hybrid kept;
        # another explicit class is the caller's choice.
        resuming = ours.get_client(client_cls=FullyAsyncLLMServerClient, only_hybrid=True)
        assert type(resuming) is continuation.ChunkedLLMServerClient and resuming._only_hybrid
        assert isinstance(resuming, FullyAsyncLLMServerClient)
        assert type(theirs.get_client(client_cls=FullyAsyncLLMServerClient)) is FullyAsyncLLMServerClient

        class Custom(LLMServerClient):
            pass

        assert type(ours.get_client(client_cls=Custom)) is Custom
    finally:
        selection.revert()
    assert LLMServerManager.get_client is original
    assert type(_manager("rollout_ext").get_client()) is LLMServerClient
    selection.apply()  # leave the process as registration left it


def test_negative_chunk_is_refused():
    from rollout_ext.verl.continuation import ChunkedLLMServerClient

    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkedLLMServerClient(_manager("rollout_ext").config, None, chunk_tokens=-1)
