"""Tiny checkpoint builder: determinism, idempotence, shapes and tokenizer (no engine)."""

import hashlib
import json

import pytest

from rollout_ext.testing import tiny_model
from rollout_ext.testing.tiny_model import build_tiny_model, default_model_dir

safetensors = pytest.importorskip("safetensors")


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_gives_identical_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="qwen2", seed=3)
    b = build_tiny_model(tmp_path / "b", arch="qwen2", seed=3)
    for name in tiny_model.REQUIRED_FILES:
        assert _sha256(a / name) == _sha256(b / name), name


def test_different_seed_gives_different_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="qwen2", seed=0)
    b = build_tiny_model(tmp_path / "b", arch="qwen2", seed=1)
    assert _sha256(a / "model.safetensors") != _sha256(b / "model.safetensors")


def test_second_build_leaves_files_untouched(tmp_path):
    out = build_tiny_model(tmp_path / "m", arch="llama")
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_tiny_model(out, arch="llama") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_changed_spec_rebuilds(tmp_path):
    out = build_tiny_model(tmp_path / "m", arch="qwen2", seed=0)
    before = _sha256(out / "model.safetensors")
    build_tiny_model(out, arch="qwen2", seed=1)
    assert _sha256(out / "model.safetensors") != before


def test_half_written_dir_is_rebuilt(tmp_path):
    out = build_tiny_model(tmp_path / "m", arch="qwen2")
    (out / "model.safetensors").unlink()
    build_tiny_model(out, arch="qwen2")
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "arch, expected",
    [
        (
            "qwen2",
            dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, hidden_size=128, intermediate_size=256,
                 vocab_size=1024, rope_theta=1e6, tie_word_embeddings=False),
        ),
        (
            "llama",
            dict(architectures=["LlamaForCausalLM"], num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=64, hidden_size=256, intermediate_size=512,
                 vocab_size=1024, rope_theta=5e5, tie_word_embeddings=False),
        ),
    ],
)
def test_config_shapes(tmp_path, arch, expected):
    out = build_tiny_model(tmp_path / arch, arch=arch)
    config = json.loads((out / "config.json").read_text())
    assert {key: config[key] for key in expected} == expected


@pytest.mark.parametrize("arch, has_qkv_bias", [("qwen2", True), ("llama", False)])
def test_weight_names_and_shapes(tmp_path, arch, has_qkv_bias):
    from safetensors import safe_open

    out = build_tiny_model(tmp_path / arch, arch=arch)
    spec = tiny_model.get_spec(arch)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        q_shape = tuple(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape())
        k_shape = tuple(f.get_slice("model.layers.1.self_attn.k_proj.weight").get_shape())
        lm_head = f.get_tensor("lm_head.weight")
    assert q_shape == (spec.num_heads * spec.head_dim, spec.hidden_size)
    assert k_shape == (spec.num_kv_heads * spec.head_dim, spec.hidden_size)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == has_qkv_bias
    assert lm_head.shape == (spec.vocab_size, spec.hidden_size)
    # The scale that keeps greedy decoding from collapsing onto one token.
    assert 0.5 <= float(lm_head.std()) <= 1.0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trips_and_matches_vocab(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    out = build_tiny_model(tmp_path / arch, arch=arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Rollout of 42 prompts: the quick brown fox, déjà vu!\n  def f(x): return x"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == tiny_model.get_spec(arch).vocab_size
    config = json.loads((out / "config.json").read_text())
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.bos_token_id == config["bos_token_id"]
    assert max(tokenizer.get_vocab().values()) == config["vocab_size"] - 1


def test_default_dir_is_in_repo_cache():
    path = default_model_dir("llama")
    assert path.parts[-3:] == (".cache", "models", "tiny-llama")


def test_unknown_arch_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama, qwen2"):
        build_tiny_model(tmp_path, arch="mistral")


def test_cli_builds(tmp_path, capsys):
    assert tiny_model.main(["--arch", "llama", "--out", str(tmp_path / "m"), "--seed", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
