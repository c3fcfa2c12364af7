"""mlp_only_tp: applies once, reverts to the exact originals, guards trip, head counts and engine check."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from packaging.version import Version

from rollout_ext.config import ExtConfig
from rollout_ext.patches import PatchError
from rollout_ext.patches import mlp_only_tp as patch

import vllm  # noqa: E402,F401

from vllm.config import ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.models import llama, qwen2  # noqa: E402

CFG = ExtConfig(mlp_only_tp=True, rope_cache=False)


def _targets():
    return [
        (qwen2.Qwen2Attention, "__init__"),
        (llama.LlamaAttention, "__init__"),
        (ModelConfig, "get_num_attention_heads"),
        (ModelConfig, "get_num_kv_heads"),
        (VllmConfig, "compute_hash"),
    ]


def _own(owner, attr):
    return owner.__dict__.get(attr)


@pytest.fixture
def originals():
    before = {t: _own(*t) for t in _targets()}
    yield before
    patch.revert()
    assert {t: _own(*t) for t in _targets()} == before


@pytest.fixture
def no_general_plugins(monkeypatch):
    # vLLM loads general plugins while building a config; this test drives the patch directly.
    monkeypatch.setenv("VLLM_PLUGINS", "")


def test_apply_is_idempotent_and_revert_restores_originals(originals):
    patch.apply(CFG)
    first = {t: _own(*t) for t in _targets()}
    assert all(first[t] is not originals[t] for t in _targets())
    patch.apply(CFG)
    assert {t: _own(*t) for t in _targets()} == first
    patch.revert()
    for target in _targets():
        assert _own(*target) is originals[target], target
    patch.revert()  # a second revert changes nothing
    for target in _targets():
        assert _own(*target) is originals[target], target


def test_version_guard_names_the_patch(originals, monkeypatch):
    monkeypatch.setattr("rollout_ext.patches._base.vllm_version", lambda: Version("0.30.0"))
    with pytest.raises(PatchError, match="'mlp_only_tp' supports vllm>=0.23,<0.28; found vllm 0.30.0"):
        patch.apply(CFG)
    assert {t: _own(*t) for t in _targets()} == originals


def test_signature_guard_trips_before_anything_is_replaced(originals, monkeypatch):
    monkeypatch.setitem(patch.ATTENTION_PARAMS, "LlamaAttention", ["hidden_size", "config"])
    with pytest.raises(PatchError, match=r"'mlp_only_tp': LlamaAttention.__init__ has parameters"):
        patch.apply(CFG)
    assert {t: _own(*t) for t in _targets()} == originals


def test_missing_disable_tp_is_refused():
    def linear_init(self, input_size, output_size, bias=True):
        pass

    with pytest.raises(PatchError, match="'mlp_only_tp'.*no 'disable_tp' parameter"):
        patch._require_keyword(linear_init, "disable_tp")


def test_tp_disabled_restores_module_globals_even_on_error():
    before = {name: getattr(qwen2, name) for name in patch.TP_GLOBALS}
    with pytest.raises(ValueError):
        with patch._tp_disabled(qwen2):
            assert qwen2.get_tensor_model_parallel_world_size() == 1
            assert qwen2.QKVParallelLinear.keywords == {"disable_tp": True}
            raise ValueError("construction failed")
    assert {name: getattr(qwen2, name) for name in patch.TP_GLOBALS} == before


@pytest.fixture(scope="module")
def qwen2_model_config(tiny_qwen2):
    return ModelConfig(model=str(tiny_qwen2), skip_tokenizer_init=True, max_model_len=512)


def test_per_rank_heads_are_whole_only_while_applied(originals, qwen2_model_config):
    tp2 = ParallelConfig(tensor_parallel_size=2)
    tp1 = ParallelConfig(tensor_parallel_size=1)
    # tiny qwen2: 4 query heads, 2 KV heads.
    assert (qwen2_model_config.get_num_attention_heads(tp2), qwen2_model_config.get_num_kv_heads(tp2)) == (2, 1)
    patch.apply(CFG)
    assert (qwen2_model_config.get_num_attention_heads(tp2), qwen2_model_config.get_num_kv_heads(tp2)) == (4, 2)
    assert (qwen2_model_config.get_num_attention_heads(tp1), qwen2_model_config.get_num_kv_heads(tp1)) == (4, 2)
    patch.revert()
    assert (qwen2_model_config.get_num_attention_heads(tp2), qwen2_model_config.get_num_kv_heads(tp2)) == (2, 1)


def test_compile_cache_key_differs_while_applied(originals, tiny_qwen2, no_general_plugins):
    args = EngineArgs(model=str(tiny_qwen2), tensor_parallel_size=2, skip_tokenizer_init=True,
                      max_model_len=512, distributed_executor_backend="mp")
    sharded = args.create_engine_config()
    sharded_key = sharded.compute_hash()
    patch.apply(CFG)
    replicated = args.create_engine_config()
    assert replicated.compute_hash() != sharded_key
    assert replicated.model_config.get_num_kv_heads(replicated.parallel_config) == 2
    assert patch.check_engine(CFG, replicated) is True


@pytest.fixture(scope="module")
def mistral_model_config(tiny_llama, tmp_path_factory):
    """The tiny llama checkpoint declared as another architecture, which the patch does not support."""
    model_dir = tmp_path_factory.mktemp("tiny-mistral")
    for item in tiny_llama.iterdir():
        shutil.copy(item, model_dir / item.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=512)


def test_unsupported_architecture_is_refused_in_strict_mode(mistral_model_config):
    engine = SimpleNamespace(
        model_config=mistral_model_config, parallel_config=ParallelConfig(tensor_parallel_size=2)
    )
    with pytest.raises(PatchError, match=r"'mlp_only_tp' supports Qwen2ForCausalLM, LlamaForCausalLM; .*Mistral"):
        patch.check_engine(CFG, engine)
    lenient = ExtConfig(mlp_only_tp=True, rope_cache=False, strict=False)
    assert patch.check_engine(lenient, engine) is False
    assert not patch.replicates_attention(mistral_model_config, engine.parallel_config)


def test_tp1_is_left_alone(qwen2_model_config):
    engine = SimpleNamespace(
        model_config=qwen2_model_config, parallel_config=ParallelConfig(tensor_parallel_size=1)
    )
    assert patch.check_engine(CFG, engine) is False
