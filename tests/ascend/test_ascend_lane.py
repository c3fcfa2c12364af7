"""The modules on vllm-ascend main's real classes, on CPU under the torch_npu emulation.

What runs for real here: vllm-ascend's Python source (../shared/upstream, commit 182b75e), vLLM
0.27.1, torch, gloo. What is emulated: every torch_npu op (bound to the real 2.14 schema, documented
math) and the HCCL backend (gloo underneath). No NPU kernel runs; see docs/modules.md.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys

import pytest
from lane import run_scenario

from rollout_ext.testing.dist import free_port

ASCEND_VERSION = "vllm-ascend main (source tree)"


def _report(output: str, prefix: str) -> list[dict]:
    """Every JSON object printed after `prefix` (two ranks' lines may interleave in one pipe)."""
    decoder, found, at = json.JSONDecoder(), [], output.find(prefix)
    while at != -1:
        found.append(decoder.raw_decode(output, at + len(prefix))[0])
        at = output.find(prefix, at + len(prefix))
    return found


@pytest.mark.parametrize("tp, dtype", [(1, "float32"), (2, "float32"), (2, "bfloat16")])
def test_qwen2_decoder_binds_rope_and_mc2_on_ascend_classes(ascend_upstream, tp, dtype):
    output = run_scenario("qwen2_modules.py", str(free_port()), str(tp), dtype)
    reports = _report(output, ": ok ")
    assert len(reports) == tp, output[-4000:]
    for report in reports:
        layers, steps = report["layers"], report["steps"]
        assert steps >= 2  # a rope that gathers once, at the first step, would pass one
        # Unpatched, vllm-ascend's rope gathers inside torch_npu.npu_mrope in every layer.
        assert report["unpatched_calls"] == {"npu_mrope": steps * layers}
        # Bound: one gather per step (the runner's update_cos_sin; the scenario checks the rows it
        # wrote), the fused rotary per layer.
        assert report["rope"]["step_gathers"] == steps and report["rope"]["layer_gathers"] == 0
        assert report["patched_calls"].get("npu_apply_rotary_pos_emb") == steps * layers
        assert "npu_mrope" not in report["patched_calls"]
        # mc2: MC2 for exactly the prefill-size calls of o_proj, down_proj and the biased layer,
        # only where the op applies (TP>1, bf16).
        fuses = tp > 1 and dtype == "bfloat16"
        log = report["mc2_log"]
        assert len(log) == steps * (4 * layers + 2) and {c["tokens"] for c in log} == {40, 3}
        assert all(c["ops"] == (["npu_mm_all_reduce_base"] if fuses and c["tokens"] == 40 else []) for c in log)
        fused = sum(fuses and c["tokens"] == 40 for c in log)
        assert report["mc2"] == {"calls": len(log) if tp > 1 else 0, "fused": fused}


# A wrong module, injected by the scenario after the plugin binds: each must fail, for its reason.
MUTATIONS = {
    # update_cos_sin that records and counts the step but never gathers (vllm-ascend's buffers wiped)
    "rope_never_gathers": ((1, "float32"), "cos/sin buffers do not hold this step's rows"),
    # the MC2 threshold inverted: only decode-size calls fuse
    "mc2_decode_only": ((2, "bfloat16"), "fused calls: {'layer': 0, 'proj': 'o_proj', 'tokens': 40"),
    # the fused kernel given the bias on every rank: the reduction sums it tp times
    "mc2_bias_every_rank": ((2, "bfloat16"), "(biased layer -1 tokens 40)"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_lane_fails_a_wrong_module(ascend_upstream, mutation):
    # The unmutated control at the same TP and dtype passes: test_qwen2_decoder_binds_rope_and_mc2_on_ascend_classes.
    (tp, dtype), reason = MUTATIONS[mutation]
    with pytest.raises(AssertionError) as failed:
        run_scenario("qwen2_modules.py", str(free_port()), str(tp), dtype, mutation)
    assert "failed (rc=1)" in str(failed.value) and reason in str(failed.value), str(failed.value)[-3000:]


def _delete_method(path, class_name: str, method: str) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = source.splitlines(keepends=True)
    start = (func.decorator_list[0].lineno if func.decorator_list else func.lineno) - 1
    del lines[start:func.end_lineno]
    path.write_text("".join(lines))


def _replace_in_method(path, class_name: str, method: str, old: str, new: str) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    lines = source.splitlines(keepends=True)
    body = "".join(lines[func.lineno - 1:func.end_lineno])
    assert old in body
    lines[func.lineno - 1:func.end_lineno] = [body.replace(old, new)]
    path.write_text("".join(lines))


def _drop_call(path, class_name: str, method: str, call: str) -> None:
    """Comment the call out: its text stays in the source, so only a guard that reads calls trips."""
    _replace_in_method(path, class_name, method, call, "pass  # " + call)


MOVES = {
    "rope forward_oot deleted": (
        "rope_cache_ascend", "ops/rotary_embedding.py",
        lambda p: _delete_method(p, "AscendRotaryEmbedding", "forward_oot"),
        "AscendRotaryEmbedding no longer defines forward_oot",
    ),
    "runner stops calling update_cos_sin": (
        "rope_cache_ascend", "worker/model_runner_v1.py",
        lambda p: _drop_call(p, "NPUModelRunner", "execute_model", "update_cos_sin(positions)"),
        "execute_model no longer calls update_cos_sin",
    ),
    "row-parallel forward deleted": (
        "mc2_ascend", "ops/linear.py",
        lambda p: _delete_method(p, "AscendRowParallelLinear", "forward"),
        "AscendRowParallelLinear no longer defines forward",
    ),
    "row-parallel forward stops falling back to vLLM's": (
        ("flashcomm", "mlp_only_tp"), "ops/linear.py",
        lambda p: _replace_in_method(p, "AscendRowParallelLinear", "forward", "return super().forward(input_)",
                                     "return self.quant_method.apply(self, input_)"),
        "AscendRowParallelLinear.forward no longer falls back to super().forward",
    ),
    "suffix proposer stops calling vLLM's": (
        "tail_drafting", "spec_decode/suffix_proposer.py",
        lambda p: _replace_in_method(p, "AscendSuffixDecodingProposer", "propose", "super().propose(",
                                     "self.propose_all("),
        "AscendSuffixDecodingProposer.propose no longer calls super().propose",
    ),
    "runner stops passing the scheduled K to the proposer": (
        "tail_drafting", "worker/model_runner_v1.py",
        lambda p: _replace_in_method(p, "NPUModelRunner", "propose_draft_token_ids",
                                     "num_speculative_tokens=scheduler_output", "scheduler_output"),
        "propose_draft_token_ids no longer passes num_speculative_tokens",
    ),
}


def _guards(upstream) -> dict:
    reports = _report(run_scenario("guards.py", str(upstream)), "GUARDS ")
    assert len(reports) == 1
    return reports[0]


def test_guards_pass_on_the_real_source(ascend_upstream):
    assert _guards(ascend_upstream) == {"rope_cache_ascend": None, "mc2_ascend": None, "flashcomm": None,
                                        "mlp_only_tp": None, "tail_drafting": None}


@pytest.mark.parametrize("move", sorted(MOVES))
def test_guard_trips_when_a_hooked_method_moves(ascend_upstream, tmp_path, move):
    patches, relative, edit, expected = MOVES[move]
    patches = (patches,) if isinstance(patches, str) else patches
    copy = tmp_path / "upstream"
    shutil.copytree(ascend_upstream / "vllm_ascend", copy / "vllm_ascend")
    edit(copy / "vllm_ascend" / relative)
    results = _guards(copy)
    for patch in patches:
        assert expected in results[patch] and ASCEND_VERSION in results[patch] and "missing hook" in results[patch]
    # The other bindings' hooks are untouched: their guards still pass on the same copy.
    assert all(error is None for name, error in results.items() if name not in patches), results


def test_strict_refusal_stops_the_engine_start(ascend_upstream, tiny_qwen2):
    env = {"VLLM_PLUGINS": "rollout_ext", "ROLLOUT_EXT_STRICT": "1"}
    # FAV2 takes whole prompts: without chunked prefill its only obstacle is the missing hook.
    refused = run_scenario("engine_start.py", str(tiny_qwen2), "--no-chunked-prefill",
                           env={**env, "ROLLOUT_EXT_FAV2": "1"})
    line = next(ln for ln in refused.splitlines() if ln.startswith("ENGINE "))
    assert line.startswith("ENGINE FAILED PatchError")
    message = refused[refused.index(line):]
    assert "module 'fav2' cannot bind on vllm-ascend main (source tree)" in message
    assert "_forward_prefill_no_cache (missing hook)" in message
    # Control: the same start without FAV2 starts, with vllm-ascend's worker patches live in the
    # worker (its GroupCoordinator built the world group), and serves a request.
    control = run_scenario("engine_start.py", str(tiny_qwen2), env={**env, "ROLLOUT_EXT_FAV2": "0"})
    started = next(ln for ln in control.splitlines() if ln.startswith("ENGINE "))
    assert started.startswith("ENGINE STARTED; generated 4 tokens"), control[-3000:]
    assert started.endswith("world group vllm_ascend.patch.worker.patch_distributed.GroupCoordinatorPatch")
    # Control: FAV2 without strict mode starts too (fav2 refused, the start goes on), so strict
    # mode, not the module alone, is what stops it.
    lenient = run_scenario("engine_start.py", str(tiny_qwen2), "--no-chunked-prefill",
                           env={**env, "ROLLOUT_EXT_FAV2": "1", "ROLLOUT_EXT_STRICT": "0"})
    assert next(ln for ln in lenient.splitlines() if ln.startswith("ENGINE ")).startswith("ENGINE STARTED")
    assert "refused=[fav2]" in lenient


def test_nonstrict_refusal_shows_in_status_line_and_doctor(ascend_upstream, repo_root):
    env = {"ROLLOUT_EXT_STRICT": "0", "ROLLOUT_EXT_FAV2": "1", "ROLLOUT_EXT_MC2": "1"}
    output = run_scenario("plugin_states.py", env=env)
    status = next(ln for ln in output.splitlines() if "rollout_ext 0.1.0: device=" in ln)
    assert "vllm-ascend=main (source tree)" in status
    assert "active=[rope_cache,mc2]" in status and "refused=[fav2]" in status
    states = _report(output, "STATES ")[0]
    assert states["fav2"]["state"] == "refused" and ASCEND_VERSION in states["fav2"]["detail"]

    code = ("import sys; sys.path.insert(0, 'tests/ascend'); import lane; lane.enter()\n"
            "from rollout_ext.__main__ import main; sys.exit(main(['doctor', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=repo_root, env={"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["vllm_ascend"] == "main (source tree)" and report["stack"] == "ascend-main"
    assert report["modules"]["fav2"]["state"] == "refused"
    assert report["modules"]["rope_cache"]["state"] == "active"
    assert report["modules"]["mc2"]["state"] == "active"
    assert report["modules"]["rope_cache"]["patch"] == "rope_cache_ascend"


def test_mlp_only_tp_replicates_attention_on_ascend_classes(ascend_upstream):
    reports = _report(run_scenario("mlp_only_tp.py", str(free_port())), ": ok ")
    assert len(reports) == 2
    for report in reports:
        # All 4 query and 2 KV heads on each of the 2 ranks; o_proj unsharded, down_proj sharded.
        assert report == {"replicated_heads": [4, 2], "o_proj_tp_size": 1, "down_proj_tp_size": 2,
                          "kv_heads_per_rank": 2}


def test_flashcomm_shards_tokens_through_ascend_linears_and_norms(ascend_upstream):
    reports = _report(run_scenario("flashcomm.py", str(free_port())), ": ok ")
    assert len(reports) == 2
    for report in reports:
        assert report["shard_rows"] == [1, 3, 4]  # 1, 5 and 8 tokens padded to a multiple of TP=2
        # The unpatched block ran vllm-ascend's own NPU ops (its norms and activation).
        assert {"npu_add_rms_norm", "npu_rms_norm", "npu_swiglu"} <= set(report["unpatched_calls"])


def test_tail_drafting_binds_vllm_ascends_suffix_proposer(ascend_upstream, tiny_qwen2):
    env = {"VLLM_PLUGINS": "rollout_ext", "ROLLOUT_EXT_TAIL_DRAFTING": "1", "ROLLOUT_EXT_STRICT": "1"}
    report = _report(run_scenario("suffix_drafting.py", str(tiny_qwen2), env=env), "SUFFIX ")[0]
    assert report["state"] == "active" and report["stack"] == "ascend-main"
    # The engine config drafts with suffix decoding, 8 tokens while at most 16 sequences run, none above.
    assert report["method"] == "suffix" and report["k_by_batch"] == {"1": 8, "16": 8, "17": 0, "32": 0}
    # vllm-ascend's proposer, called as its runner calls it: the scheduled K, capped per sequence by
    # how long it has run (the second row ran a quarter as long: 1 token).
    assert report["proposer"] == "AscendSuffixDecodingProposer"
    assert report["bound"] == [[7, 8, 9, 10], [10]] and report["full_batch"] == [[], []]
    # Control: unpatched, vLLM's proposer under it asserts that the step's K is the configured one.
    assert report["control"] == "AssertionError"


def test_every_swap_on_vllm_ascend_main_is_in_the_record(ascend_upstream, repo_root):
    # The audit of tests/unit/test_module_hooks.py (with its unlisted-swap control), on main's classes.
    sys.path.insert(0, str(repo_root / "tests" / "unit"))
    from hook_audit import run as audit

    report = audit("--ascend")
    assert {name: entry["unlisted"] for name, entry in report.items() if entry["unlisted"]} == {}
    assert "vllm_ascend.ops.linear.AscendRowParallelLinear.forward" in report["mc2"]["swapped"]
    assert "vllm_ascend.ops.rotary_embedding.AscendRotaryEmbedding.__init__" in report["rope_cache"]["swapped"]
