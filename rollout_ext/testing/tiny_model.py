"""Builds tiny random-weight Hugging Face checkpoints (Qwen2, Llama) for tests and benchmarks.

There is no model hub on the machines we test on, so every checkpoint is generated locally in a
second or two: config.json, model.safetensors, generation_config.json and a small byte-level BPE
tokenizer trained in-process. The same spec and seed always give byte-identical weights, and a
stamp file makes a second build of the same spec a no-op.

Two shapes exist on purpose (different head_dim, GQA ratio, qkv bias, rope_theta) so that no
module gets tuned to a single layout.

CLI: python -m rollout_ext.testing.tiny_model --arch qwen2 --out DIR [--seed N]
     python -m rollout_ext.testing.tiny_model --arch qwen2 --task arith --out DIR (a trained model,
     see rollout_ext.testing.arith_model)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from pathlib import Path

# Bump when the files written change, so that old stamps stop matching.
BUILDER_VERSION = 3
STAMP_NAME = "tiny_model_stamp.json"
WEIGHTS_NAME = "model.safetensors"
REQUIRED_FILES = (
    "config.json",
    WEIGHTS_NAME,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
BOS_TOKEN = "<|bos|>"
# Qwen2Tokenizer (which transformers picks from model_type) adds "<|endoftext|>" as unk if it is
# missing; naming eos so keeps len(tokenizer) equal to vocab_size for both archs.
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DTYPES = ("float32", "bfloat16", "float16")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Embedded training text for the tokenizer. Any English prose works; it only has to give the BPE
# trainer enough pairs so that prompts tokenize into a mix of merged and byte tokens.
TOKENIZER_TEXT = """\
Reinforcement learning from feedback alternates two phases. In the rollout phase an inference
engine generates many responses for each prompt; in the training phase the policy is updated from
the rewards of those responses. The rollout phase often dominates the wall clock, because response
lengths have a long tail: most sequences finish early while a few run until the length cap.
A scheduler that knows which sequences will be long can place them on lightly loaded replicas.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 and 3.14159 appear in math problems.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
Attention computes a weighted sum of values, where the weights come from queries and keys.
Rotary position embeddings rotate queries and keys by an angle that grows with the position.
Tensor parallelism splits each matrix across devices and joins partial results with collectives.
A small model with random weights is enough to test that two code paths give the same tokens.
"""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinySpec:
    """The shape of one tiny architecture."""

    architecture: str  # HF class name, e.g. "Qwen2ForCausalLM"
    model_type: str  # HF config model_type
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    qkv_bias: bool
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6


SPECS: dict[str, TinySpec] = {
    "qwen2": TinySpec(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        num_layers=2,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=1024,
        rope_theta=1e6,
        qkv_bias=True,
    ),
    "llama": TinySpec(
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=512,
        vocab_size=1024,
        rope_theta=5e5,
        qkv_bias=False,
    ),
    # A third shape that no module was developed against: 3 layers, GQA 3, an intermediate size
    # that is not a power of two, a vocab that is not a multiple of 64.
    "qwen2-odd": TinySpec(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        num_layers=3,
        hidden_size=192,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=224,
        vocab_size=1000,
        rope_theta=2e5,
        qkv_bias=True,
    ),
}


def get_spec(arch: str) -> TinySpec:
    if arch not in SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(sorted(SPECS))}")
    return SPECS[arch]


def repo_root() -> Path | None:
    """The source checkout this module lives in, or None when installed elsewhere."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def default_model_dir(arch: str) -> Path:
    """Where the Makefile and the benchmark keep tiny models: <repo>/.cache/models/tiny-<arch>."""
    get_spec(arch)
    root = repo_root()
    base = root / ".cache" if root is not None else Path.home() / ".cache" / "rollout_ext"
    return base / "models" / f"tiny-{arch}"


def spec_hash(arch: str, seed: int, dtype: str) -> str:
    payload = {
        "builder_version": BUILDER_VERSION,
        "arch": arch,
        "spec": dataclasses.asdict(get_spec(arch)),
        "seed": seed,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def is_valid_checkpoint(out_dir: Path, expected_hash: str) -> bool:
    stamp = out_dir / STAMP_NAME
    if not stamp.is_file() or not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads(stamp.read_text()).get("spec_hash") == expected_hash
    except (OSError, ValueError):
        return False


def build_tiny_model(
    out_dir: str | os.PathLike | None = None,
    arch: str = "qwen2",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Writes a random-weight checkpoint to out_dir (default: default_model_dir(arch)).

    Returns the directory. If it already holds a checkpoint of the same spec, seed and dtype,
    nothing is rewritten.
    """
    spec = get_spec(arch)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    out = Path(out_dir) if out_dir is not None else default_model_dir(arch)
    expected_hash = spec_hash(arch, seed, dtype)
    if is_valid_checkpoint(out, expected_hash):
        return out
    out.mkdir(parents=True, exist_ok=True)
    # The stamp goes last and is removed first, so a half-written directory is never "valid".
    (out / STAMP_NAME).unlink(missing_ok=True)

    tokenizer = _train_tokenizer(spec.vocab_size)
    special_ids = {tok: tokenizer.token_to_id(tok) for tok in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
    _atomic_write_text(out / "tokenizer.json", tokenizer.to_str(pretty=True))
    _atomic_write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    _atomic_write_json(out / "config.json", _model_config(spec, dtype, special_ids))
    _atomic_write_json(out / "generation_config.json", _generation_config(special_ids))
    _write_weights(out / WEIGHTS_NAME, spec, seed, dtype)
    _atomic_write_json(out / STAMP_NAME, {"spec_hash": expected_hash, "arch": arch, "seed": seed})
    return out


def _model_config(spec: TinySpec, dtype: str, special_ids: dict[str, int]) -> dict:
    config = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, older readers read rope_theta.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
    }
    if spec.model_type == "qwen2":
        config["use_sliding_window"] = False
        config["max_window_layers"] = spec.num_layers
    else:
        config["attention_bias"] = spec.qkv_bias
        config["mlp_bias"] = False
    return config


def _generation_config(special_ids: dict[str, int]) -> dict:
    # Only token ids: sampling defaults here would silently change vLLM's defaults.
    return {
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
    }


def _tokenizer_config(spec: TinySpec) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": EOS_TOKEN,
        "add_bos_token": False,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        # Plain-text roles: RL frameworks render prompts with apply_chat_template.
        "chat_template": CHAT_TEMPLATE,
    }


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on TOKENIZER_TEXT, padded with filler tokens to vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # Leave room for fillers; the small text yields far fewer merges than this anyway.
        vocab_size=vocab_size // 2,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_TEXT.splitlines(), trainer=trainer)
    # Fillers make len(tokenizer) equal the embedding rows, so every id the model can emit decodes.
    num_fillers = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if num_fillers < 0:
        raise ValueError(f"tokenizer already has more than vocab_size={vocab_size} tokens")
    tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(num_fillers)])
    return tokenizer


def _weight_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    hidden, q_dim = spec.hidden_size, spec.num_heads * spec.head_dim
    kv_dim, inter = spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    # Large embedding and lm_head scales give wide, well-separated logits: greedy decoding then
    # varies from step to step and fp32 rounding differences between engines do not flip argmax.
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0.7
    if name.endswith(".bias"):
        return 0.1
    # Unit-variance outputs, so attention and MLP move the residual stream as much as the embedding
    # does and the next token depends on context, not only on the current token.
    return shape[1] ** -0.5


def _write_weights(path: Path, spec: TinySpec, seed: int, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _weight_shapes(spec).items():
        if name.endswith("norm.weight"):
            # Near one: a norm with random sign or scale near zero would wash out the signal.
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensor = _init_std(name, shape) * torch.randn(shape, generator=generator)
        tensors[name] = tensor.to(getattr(torch, dtype)).contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors creates 0600; other users of a shared cache must read it
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    # Concurrent builders of the same spec write identical bytes; replace keeps readers safe.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_write_json(path: Path, obj: dict) -> None:
    _atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(SPECS), default="qwen2")
    parser.add_argument("--out", type=Path, default=None, help="default: <repo>/.cache/models/tiny-<arch>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--task", choices=("random", "arith"), default="random",
                        help="random: random weights; arith: trained on arithmetic (minutes, qwen2, "
                             "float32; default out: <repo>/.cache/models/arith-qwen2)")
    args = parser.parse_args(argv)
    if args.task == "arith":
        if args.arch != "qwen2":
            parser.error(f"--task arith needs --arch qwen2, got --arch {args.arch}")
        if args.dtype != "float32":
            parser.error(f"--task arith needs --dtype float32, got --dtype {args.dtype}")
        from rollout_ext.testing.arith_model import build_arith_model

        print(build_arith_model(args.out, seed=args.seed))
        return 0
    print(build_tiny_model(args.out, arch=args.arch, seed=args.seed, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
