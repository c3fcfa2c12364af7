"""bench/offline.py as users run it: a script, variants in fresh engines, JSON + PNG out."""

import json
import os
import subprocess
import sys

import pytest


def _run_bench(repo_root, *args, timeout_s=300, env=None):
    return subprocess.run([sys.executable, str(repo_root / "bench" / "offline.py"), *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=repo_root, env=env)


@pytest.mark.parametrize(
    "args, must_mention",
    [
        (["--variants", "off,turbo"], ["--variants", "'turbo'", "rope_cache", "mlp_only_tp"]),
        (["--variants", "mc2+flashcomm"], ["--variants", "mc2+flashcomm", "FLASHCOMM"]),
        (["--num-prompts", "0"], ["--num-prompts", "0", ">= 1"]),
        (["--dtype", "fp8"], ["--dtype", "'fp8'", "float32"]),
        (["--output-dist", "zipf"], ["--output-dist", "'zipf'", "longtail"]),
        (["--workload", "chess"], ["--workload", "'chess'", "random, arith"]),
    ],
)
def test_bad_values_name_flag_value_and_choices(repo_root, args, must_mention):
    proc = _run_bench(repo_root, *args, timeout_s=60)
    assert proc.returncode == 2
    for text in must_mention:
        assert text in proc.stderr, proc.stderr


def test_npu_only_variant_is_skipped_not_failed(repo_root, tmp_path, tiny_qwen2):
    from rollout_ext.platform import device_type

    if device_type() == "npu":
        pytest.skip("fav2 runs for real on NPU")
    out = tmp_path / "fav2.json"
    proc = _run_bench(repo_root, "--model", str(tiny_qwen2), "--variants", "fav2", "--json", str(out),
                      timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = json.loads(out.read_text())["variants"]
    assert record["status"] == "skipped" and record["reason"] == "NPU only"
    assert record["env"]["ROLLOUT_EXT_FAV2"] == "1"
    assert "skipped: NPU only" in proc.stdout


@pytest.mark.heavy
def test_off_and_vanilla_write_json_and_png(repo_root, tmp_path, tiny_qwen2):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = _run_bench(repo_root, "--model", str(tiny_qwen2), "--variants", "off,vanilla",
                      "--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--enforce-eager",
                      "--json", str(json_path), "--plot", str(png_path),
                      # This checks the bench's plumbing, not its numbers: each variant's EngineCore
                      # runs in the variant's process, one vLLM start (~25 s here) fewer per variant.
                      env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(json_path.read_text())
    setup = result["setup"]
    for key in ("python", "torch", "vllm", "device", "cpu_model", "model", "arch", "tp", "dtype", "seed", "args"):
        assert key in setup, key
    assert setup["arch"] == "Qwen2ForCausalLM" and setup["tp"] == 1

    off, vanilla = result["variants"]
    assert [off["name"], vanilla["name"]] == ["off", "vanilla"]
    assert off["status"] == vanilla["status"] == "ok"
    assert off["ratio_vs_off"] == 1.0
    assert vanilla["ratio_vs_off"] == pytest.approx(vanilla["tokens_per_s"] / off["tokens_per_s"])
    assert off["generated_tokens"] == vanilla["generated_tokens"] == 4 * 8
    assert off["tokens_per_s"] > 0 and off["ttft_ms"] > 0
    assert off["env"]["VLLM_PLUGINS"] == "rollout_ext" and off["env"]["ROLLOUT_EXT_ROPE_CACHE"] == "0"
    assert vanilla["env"]["VLLM_PLUGINS"] == ""
    # Greedy decoding with no module on must not change a single token.
    assert vanilla["same_tokens_as_off"] is True

    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vanilla" in proc.stdout and "tokens/s" in proc.stdout


def test_the_arith_workload_stops_at_the_answer_and_prints_two_responses(repo_root, tmp_path, arith_model):
    from rollout_ext.testing import arith

    json_path = tmp_path / "bench.json"
    proc = _run_bench(repo_root, "--workload", "arith", "--variants", "off,rope_cache", "--num-prompts", "8",
                      "--output-cap", "512", "--repeats", "1", "--enforce-eager", "--json", str(json_path),
                      env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    off, rope_cache = json.loads(json_path.read_text())["variants"]
    assert off["status"] == rope_cache["status"] == "ok" and rope_cache["same_tokens_as_off"] is True
    # Every response stopped at EOS, long before the cap.
    assert 0 < off["generated_tokens"] < 8 * 200
    samples = [line.split(": ", 1)[1] for line in proc.stdout.splitlines()
               if line.startswith("sample response (off): ")]
    assert len(samples) == 2
    for text in samples:
        prompt, response = text.split("=", 1)
        problem_answer = eval(prompt.removeprefix("Q:"))  # the prompt is a plain +/- chain
        assert arith.is_correct(response, problem_answer), text
