"""Tiny checkpoints are sane: real vLLM (CPU, fp32, eager) greedy output equals HF generate."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.heavy

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return"]
MAX_TOKENS = 24

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=256 * 2**20)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""")


def _hf_greedy(model_dir, prompt_ids):
    """Plain argmax loop: generate()'s min_new_tokens would mask EOS, which ignore_eos does not."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            tokens = torch.tensor([ids])
            for _ in range(MAX_TOKENS):
                next_id = model(tokens).logits[0, -1].argmax()
                tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
            out.append(tokens[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_vllm_greedy_equals_hf_generate(arch, tiny_model_dir, tmp_path, engine_cache_env, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model_dir = tiny_model_dir(arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]

    script = tmp_path / "vllm_greedy.py"
    script.write_text(VLLM_SCRIPT)
    for name, value in engine_cache_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_PLUGINS", "")  # the checkpoint alone, no rollout_ext patches
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: ~30 s less on 2 cores
    proc = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(prompt_ids), str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result_line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    vllm_ids = json.loads(result_line[len("RESULT "):])

    assert vllm_ids == _hf_greedy(model_dir, prompt_ids)
    # Random weights must still give varied tokens, or equality would prove little.
    for ids in vllm_ids:
        assert len(set(ids)) >= MAX_TOKENS // 3, ids
