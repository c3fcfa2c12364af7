"""What a rollout_ext binding for vllm-ascend 0.23.0 relies on, checked against its recorded source.

vllm_ascend_0.23.0.contract.json is extracted from the released wheel by extract_ascend_contract.py
(ast only, nothing imported). These tests need neither the wheel nor the network, except one:
`make setup` downloads the wheel (never installs it) into .cache/wheels, and that test re-extracts
the contract from it and compares.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import pathlib
import re
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CONTRACT_FILE = HERE / "vllm_ascend_0.23.0.contract.json"
WHEEL_DIR = HERE.parents[1] / ".cache" / "wheels"
DOWNLOAD = "make setup (or: make .cache/wheels/vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl)"

ROPE = "vllm_ascend.ops.rotary_embedding"
LINEAR = "vllm_ascend.ops.linear"
LINEAR_OP = "vllm_ascend.ops.linear_op"
RUNNER = "vllm_ascend.worker.model_runner_v1"
ATTN = "vllm_ascend.attention.attention_v1"


def _load_extractor():
    spec = importlib.util.spec_from_file_location("extract_ascend_contract", HERE / "extract_ascend_contract.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


ext = _load_extractor()
CONTRACT = json.loads(CONTRACT_FILE.read_text())
TARGETS = CONTRACT["targets"]


def rec(module: str, name: str) -> dict:
    return TARGETS[f"{module}:{name}"]


def names(record: dict) -> list[str]:
    return [p["name"] for p in record["params"]]


def calls(record: dict, func: str) -> list[dict]:
    return [c for c in record["calls"] if c["func"] == func]


def all_funcs(record: dict) -> set[str]:
    return {c["func"] for c in record["calls"]}


# --- the file itself ------------------------------------------------------------------------------


def test_contract_names_wheel_sha256_and_is_canonical():
    assert re.fullmatch(r"vllm_ascend-0\.23\.0-cp311-cp311-manylinux\S+\.whl", CONTRACT["source"]["name"])
    assert re.fullmatch(r"[0-9a-f]{64}", CONTRACT["source"]["sha256"])
    assert CONTRACT_FILE.read_text() == ext.dumps(CONTRACT)  # sorted, stable: regenerating gives no noise


def test_contract_covers_every_target_and_only_the_expected_one_is_absent():
    assert set(TARGETS) == {f"{t.module}:{t.name}" for t in ext.TARGETS}
    assert all(r["why"] for r in TARGETS.values())
    absent = {k for k, r in TARGETS.items() if not r["exists"]}
    assert absent == {f"{ATTN}:AscendAttentionBackendImpl._forward_prefill_no_cache"}


# --- what the 0.23 bindings' runtime guards require -----------------------------------------------


def _params_start(module: str, name: str, expected: list[str]) -> bool:
    """_ascend.require_params: the parameters other than self start with `expected`."""
    r = rec(module, name)
    return r["exists"] and [n for n in names(r) if n != "self"][: len(expected)] == expected


def _module_binds(module: str, name: str) -> bool:
    """`name` is a global of `module` bound unconditionally at top level (so it is in vars(module))."""
    m = CONTRACT["modules"][module]
    return m["exists"] and name in m["assigned"]


def _imports_by_name_only(module: str, source: str, name: str) -> bool:
    """`module` binds `name` by `from source import name` and by nothing else, so that
    `module.name is source.name` (rope_cache_ascend swaps the runner module's global)."""
    m = CONTRACT["modules"][module]
    others = [src for src, bound in m["from_imports"].items() if src != source and any(
        b == name or b.endswith(f" as {name}") for b in bound)]
    return (m["exists"] and name in m["from_imports"].get(source, [])
            and name not in m["assigned"] and name not in m["defined"] and not others)


def test_every_hook_the_023_bindings_guard_exists():
    rope_cls, layer_cls = f"{ROPE}:AscendRotaryEmbedding", f"{LINEAR}:AscendRowParallelLinear"
    # (patch, module, what, why, check): each requirement of the runtime guards
    # rope_cache_ascend.check_upstream(), mc2_ascend.check_upstream() and fav2_attention.apply(),
    # checked against the 0.23.0 wheel's recorded source.
    requirements = [
        ("rope_cache_ascend", ROPE, "class AscendRotaryEmbedding", "the class whose methods are swapped",
         lambda: TARGETS[rope_cls]["exists"]),
        ("rope_cache_ascend", ROPE, "AscendRotaryEmbedding defines __init__ itself (require_own)",
         "wrapped to mark layers that can read the step buffers",
         lambda: "__init__" in TARGETS[rope_cls]["methods"]),
        ("rope_cache_ascend", ROPE, "AscendRotaryEmbedding defines forward_oot itself (require_own)",
         "replaced by the per-step rotate", lambda: "forward_oot" in TARGETS[rope_cls]["methods"]),
        ("rope_cache_ascend", ROPE, "forward_oot(positions, query, key, offsets, is_neox_style_override, ...)",
         "the wrapper's signature and its fallback call",
         lambda: _params_start(ROPE, "AscendRotaryEmbedding.forward_oot",
                               ["positions", "query", "key", "offsets", "is_neox_style_override"])),
        ("rope_cache_ascend", ROPE, "__init__(head_size, rotary_dim, max_position_embeddings, base, "
         "is_neox_style, dtype, ...)", "the layer attributes step_eligible reads",
         lambda: _params_start(ROPE, "AscendRotaryEmbedding.__init__",
                               ["head_size", "rotary_dim", "max_position_embeddings", "base",
                                "is_neox_style", "dtype"])),
        ("rope_cache_ascend", ROPE, "update_cos_sin(positions)", "the per-step gather the runner calls; wrapped",
         lambda: _params_start(ROPE, "update_cos_sin", ["positions"])),
        *[("rope_cache_ascend", ROPE, f"module global {buf} (top-level assignment)",
           "per-step buffer / table the layers read", lambda buf=buf: _module_binds(ROPE, buf))
          for buf in ("_cos", "_sin", "_cos_sin_cache")],
        ("rope_cache_ascend", RUNNER, "class NPUModelRunner", "the runner whose step fills the buffers",
         lambda: rec(RUNNER, "NPUModelRunner")["exists"]),
        ("rope_cache_ascend", RUNNER, f"`from {ROPE} import update_cos_sin`, not rebound",
         "swapping the runner module's global reaches execute_model's call",
         lambda: _imports_by_name_only(RUNNER, ROPE, "update_cos_sin")),
        ("rope_cache_ascend", RUNNER, "NPUModelRunner.execute_model calls update_cos_sin(...)",
         "the once-per-step call the wrapped global records",
         lambda: rec(RUNNER, "NPUModelRunner.execute_model")["exists"]
         and bool(calls(rec(RUNNER, "NPUModelRunner.execute_model"), "update_cos_sin"))),
        ("mc2_ascend", LINEAR, "class AscendRowParallelLinear", "the class whose methods are swapped",
         lambda: TARGETS[layer_cls]["exists"]),
        ("mc2_ascend", LINEAR, "AscendRowParallelLinear defines __init__ itself (require_own)",
         "wrapped to track each layer by prefix", lambda: "__init__" in TARGETS[layer_cls]["methods"]),
        ("mc2_ascend", LINEAR, "AscendRowParallelLinear defines forward itself (require_own)",
         "wrapped to route to the mc2 op", lambda: "forward" in TARGETS[layer_cls]["methods"]),
        ("mc2_ascend", LINEAR, "__init__(input_size, output_size, bias, input_is_parallel, ...)",
         "the layer attributes takes_over reads",
         lambda: _params_start(LINEAR, "AscendRowParallelLinear.__init__",
                               ["input_size", "output_size", "bias", "input_is_parallel"])),
        ("mc2_ascend", LINEAR, "forward(input_, ...)", "the wrapper's signature and its fallback call",
         lambda: _params_start(LINEAR, "AscendRowParallelLinear.forward", ["input_"])),
        ("mc2_ascend", LINEAR, "__init__ assigns self.custom_op", "the wrapper leaves layers with an op to vllm-ascend",
         lambda: "custom_op" in TARGETS[layer_cls]["init_self_attributes"]),
        ("fav2_attention", ATTN, "AscendAttentionBackendImpl._forward_prefill_no_cache is ABSENT",
         "apply() requires it, so fav2 refuses on 0.23.0 rather than binding",
         lambda: rec(ATTN, "AscendAttentionBackendImpl._forward_prefill_no_cache")["exists"] is False),
    ]
    failed = [f"{patch}: {module}: {what} ({why})" for patch, module, what, why, check in requirements if not check()]
    assert not failed, "the 0.23.0 wheel no longer provides:\n" + "\n".join(failed)
    assert {patch for patch, *_ in requirements} == {"rope_cache_ascend", "mc2_ascend", "fav2_attention"}


# --- version facts (f) ----------------------------------------------------------------------------


def test_package_version_and_the_vllm_it_targets():
    pkg = CONTRACT["package"]
    assert pkg["version_py"]["__version__"] == "0.23.0"  # vllm_ascend/_version.py (vcs-versioning)
    assert pkg["metadata"]["version"] == "0.23.0"
    assert pkg["build_info_py"]["__device_type__"] == "A2"  # the PyPI wheel is built for A2
    # The only vLLM version the code branches on is 0.23.0; the wheel does not pin vllm itself.
    assert set(pkg["vllm_version_is_calls"]) == {"0.23.0"}
    assert not [r for r in pkg["metadata"]["requires_dist"] if re.match(r"vllm\b", r)]
    # It pairs with torch 2.10 / torch-npu 2.10.0.post4 (not the 2.14 the op schemas here come from).
    assert "torch-npu==2.10.0.post4" in pkg["metadata"]["requires_dist"]
    assert "torch==2.10.0" in pkg["metadata"]["requires_dist"]
    assert pkg["entry_points"]["vllm.platform_plugins"] == {"ascend": "vllm_ascend:register"}


# --- rope (a) -------------------------------------------------------------------------------------


def test_rope_forward_oot_signature():
    r = rec(ROPE, "AscendRotaryEmbedding.forward_oot")
    assert names(r) == ["self", "positions", "query", "key", "offsets", "is_neox_style_override"]
    assert [p.get("default") for p in r["params"][4:]] == ["None", "None"]
    assert rec(ROPE, "AscendRotaryEmbedding")["bases"] == ["RotaryEmbedding"]
    init = rec(ROPE, "AscendRotaryEmbedding.__init__")
    assert names(init) == ["self", "head_size", "rotary_dim", "max_position_embeddings", "base", "is_neox_style",
                           "dtype", "init_cache"]
    assert calls(init, "_record_cos_sin_cache")[0]["args"] == ["self.cos_sin_cache"]


def test_rope_plain_path_gathers_per_layer_from_the_whole_cache():
    fwd = rec(ROPE, "AscendRotaryEmbedding.forward_oot")
    (op,) = calls(fwd, "torch.ops.vllm.npu_rotary_embedding")
    assert op["args"] == ["positions", "query", "key", "self.cos_sin_cache", "self.head_size", "self.rotary_dim",
                          "is_neox_style"]
    reg = [c for c in rec("vllm_ascend.ops.register_custom_ops", "call:direct_register_custom_op")["calls"]
           if c["keywords"]["op_name"] == "'npu_rotary_embedding'"]
    assert [c["keywords"]["op_func"] for c in reg] == ["rope_forward_oot"]

    body = rec(ROPE, "rope_forward_oot")
    assert names(body)[:7] == ["positions", "query", "key", "cos_sin_cache", "head_size", "rotary_dim",
                               "is_neox_style"]
    (triton,) = calls(body, "rope_forward_triton")
    assert triton["tests"][-1] == "HAS_TRITON"
    assert triton["keywords"]["cos_sin_cache"] == "cos_sin_cache" and triton["keywords"]["positions"] == "positions"
    atb = calls(body, "torch_npu._npu_rotary_embedding")
    assert len(atb) == 2 and all("not (HAS_TRITON)" in c["tests"] for c in atb)
    assert all(len(c["args"]) == 6 and c["args"][4] == "cos_sin_cache" and not c["keywords"] for c in atb)
    # Neither the A2/A3 forward nor its body reads the per-step buffers.
    for r in (fwd, body):
        assert not all_funcs(r) & {"get_cos_and_sin_slice", "torch_npu.npu_apply_rotary_pos_emb", "torch_npu.npu_mrope"}


def test_rope_per_step_buffers_exist_and_the_runner_fills_them():
    assert names(rec(ROPE, "update_cos_sin")) == ["positions"]
    assert names(rec(ROPE, "get_cos_and_sin_slice")) == []
    assert names(rec(ROPE, "set_cos_and_sin")) == ["vllm_config", "max_num_reqs", "decode_token_per_req", "dtype",
                                                   "device"]
    step = rec(RUNNER, "NPUModelRunner.execute_model")
    (fill,) = calls(step, "update_cos_sin")
    (fwd,) = calls(step, "self._model_forward")
    assert fill["args"] == ["positions"] and fill["lineno"] < fwd["lineno"]
    assert calls(rec(RUNNER, "NPUModelRunner._dummy_run"), "update_cos_sin")[0]["args"] == ["positions"]
    # In 0.23.0 only the 310P rope reads them, with npu_apply_rotary_pos_emb(q, k, cos, sin, rotary_mode=...).
    p310 = rec("vllm_ascend._310p.ops.rotary_embedding", "_rope_forward_oot")
    assert calls(p310, "get_cos_and_sin_slice")
    apply = calls(p310, "torch_npu.npu_apply_rotary_pos_emb")
    assert apply and all(len(c["args"]) == 4 and set(c["keywords"]) == {"rotary_mode"} for c in apply)
    # npu_mrope is used only by M-RoPE.
    (mrope,) = calls(rec(ROPE, "AscendMRotaryEmbedding.forward_oot"), "torch_npu.npu_mrope")
    assert len(mrope["args"]) == 5 and set(mrope["keywords"]) == {"mrope_section", "rotary_mode"}


# --- model runner ---------------------------------------------------------------------------------


def test_model_runner_signatures():
    assert rec(RUNNER, "NPUModelRunner")["bases"] == ["GPUModelRunner"]
    fwd = rec(RUNNER, "NPUModelRunner._model_forward")
    assert names(fwd) == ["self", "num_tokens_padded", "input_ids", "positions", "intermediate_tensors",
                          "inputs_embeds", "model_kwargs"]
    assert fwd["params"][-1]["kind"] == "var_keyword"
    assert all(p["has_default"] for p in fwd["params"][2:6])
    assert names(rec(RUNNER, "NPUModelRunner.execute_model")) == ["self", "scheduler_output", "intermediate_tensors"]


# --- linear / mc2 / flashcomm1 (b, c) -------------------------------------------------------------


def test_linear_forwards_take_input_():
    row = rec(LINEAR, "AscendRowParallelLinear.forward")
    assert names(row) == ["self", "input_", "kwargs"] and row["params"][2]["kind"] == "var_keyword"
    for cls in ("AscendColumnParallelLinear", "AscendQKVParallelLinear", "AscendMergedColumnParallelLinear"):
        assert names(rec(LINEAR, f"{cls}.forward")) == ["self", "input_"], cls
    init = rec(LINEAR, "AscendRowParallelLinear.__init__")
    kinds = {p["name"]: p["kind"] for p in init["params"]}
    assert kinds["prefix"] == "positional_or_keyword"
    assert kinds["return_bias"] == kinds["disable_tp"] == "keyword_only"
    assert calls(init, "get_parallel_op")[0]["args"] == ["disable_tp", "prefix", "self", "'row'"]
    assert calls(rec(LINEAR_OP, "CustomLinearOp.apply"), "self.apply_impl")[0]["args"] == ["input_"]


def test_mc2_op_calls_npu_mm_all_reduce_base_without_a_token_threshold():
    r = rec(LINEAR_OP, "MatmulAllreduceRowParallelOp.apply_impl")
    assert names(r) == ["self", "input_"]
    (mm,) = calls(r, "torch_npu.npu_mm_all_reduce_base")
    assert mm["args"] == ["input_parallel", "self.layer.weight.t()", "self.hcomm_info"]
    assert mm["keywords"] == {"bias": "bias_"}
    assert mm["tests"] == ["self.reduce_results and self.tp_size > 1"]  # no num_tokens condition
    cls = rec(LINEAR_OP, "MatmulAllreduceRowParallelOp")
    assert cls["bases"] == ["CustomRowParallelOp"]
    assert "_HCOMM_INFO" in cls["attributes"]  # one comm name cached per class, not per group
    hcomm = rec(LINEAR_OP, "MatmulAllreduceRowParallelOp.get_hcomm_info")
    assert any(c["func"].endswith("get_hccl_comm_name") for c in hcomm["calls"])


def test_row_op_selection_order_mc2_before_flashcomm1():
    branches = rec(LINEAR_OP, "_get_row_parallel_op")["branches"]
    by_value = {b["value"]: b for b in branches}
    mc2 = by_value["MatmulAllreduceRowParallelOp(layer)"]
    assert mc2["tests"][-1] == "matmul_allreduce_enable()"  # any row layer, dense or not
    seq = by_value["SequenceRowParallelOp(layer)"]
    assert "not (matmul_allreduce_enable())" in seq["tests"] and "enable_sp()" in seq["tests"]
    assert mc2["lineno"] < seq["lineno"]
    mlp = by_value["MLPRowParallelOp(layer)"]
    assert "mlp_tp_enable()" in mlp["tests"][-1] and "'down_proj' in prefix" in mlp["tests"][-1]
    col = {b["value"] for b in rec(LINEAR_OP, "_get_column_parallel_op")["branches"]}
    assert {"SequenceColumnParallelOp(layer)", "MLPColumnParallelOp(layer)"} <= col
    assert rec("vllm_ascend.utils", "matmul_allreduce_enable")["branches"][0]["value"] == (
        "get_ascend_config().enable_matmul_allreduce")


def test_flashcomm1_mechanism():
    ctx = rec("vllm_ascend.ascend_forward_context", "set_ascend_forward_context")
    dense = [a for a in ctx["assigns"] if a["target"] == "flash_comm_v1_enabled" and "num_tokens > 1000" in a["value"]]
    assert dense and dense[0]["tests"] == ["not (is_context_moe_model)", "not (is_draft_model)"]
    seq = rec(LINEAR_OP, "SequenceRowParallelOp.matmul_and_reduce")
    assert {"tensor_model_parallel_all_reduce", "tensor_model_parallel_reduce_scatter",
            "DeviceOperator.npu_mm_reduce_scatter_base"} <= all_funcs(seq)
    assert calls(rec(LINEAR_OP, "SequenceRowParallelOp.apply_impl"), "torch.ops.vllm.matmul_and_reduce")
    assert calls(rec(LINEAR_OP, "SequenceColumnParallelOp.apply_impl"), "torch.ops.vllm.maybe_all_gather_and_maybe_unpad")
    emb = rec("vllm_ascend.ops.vocab_parallel_embedding", "AscendVocabParallelEmbedding._forward_origin")
    assert calls(emb, "torch.ops.vllm.maybe_pad_and_reduce")
    gather = rec(RUNNER, "NPUModelRunner._model_forward")
    assert calls(gather, "self._all_gather_hidden_states_and_aux")


def test_rmsnorm_forward_oot():
    r = rec("vllm_ascend.ops.layernorm", "AscendRMSNorm.forward_oot")
    assert names(r) == ["self", "x", "residual"] and r["params"][2]["default"] == "None"
    (chunk,) = calls(r, "torch.ops.vllm.maybe_chunk_residual")
    assert chunk["tests"] == ["residual is not None"]
    assert calls(r, "torch_npu.npu_add_rms_norm") and calls(r, "torch_npu.npu_rms_norm")


# --- attention (d) --------------------------------------------------------------------------------


def test_attention_prefill_path():
    absent = rec(ATTN, "AscendAttentionBackendImpl._forward_prefill_no_cache")
    assert absent["exists"] is False and "not defined" in absent["reason"]
    fwd = rec(ATTN, "AscendAttentionBackendImpl.forward")
    assert names(fwd) == ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                          "output_scale", "output_block_scale"]
    impl = rec(ATTN, "AscendAttentionBackendImpl.forward_impl")
    assert {"self.forward_paged_attention", "self.forward_fused_infer_attention"} <= all_funcs(impl)
    fia = rec(ATTN, "AscendAttentionBackendImpl.forward_fused_infer_attention")
    assert names(fia) == ["self", "query", "key", "value", "attn_metadata", "output", "kv_cache"]
    direct = calls(fia, "torch_npu.npu_fused_infer_attention_score")
    assert direct and all(not c["args"] and c["keywords"]["input_layout"] == "'TND'" for c in direct)
    (causal,) = calls(fia, "DeviceOperator.npu_fused_infer_attention_score")
    assert causal["keywords"]["sparse_mode"] == "3"
    assert causal["tests"][-1] == "not (self.sliding_window is not None)"
    wrapper = rec("vllm_ascend.device.device_op", "BaseDeviceAdaptor.npu_fused_infer_attention_score")
    assert calls(wrapper, "torch_npu.npu_fused_infer_attention_score")
    state = rec(ATTN, "AscendAttentionState")
    assert {"PrefillNoCache", "PrefillCacheHit", "DecodeOnly", "ChunkedPrefill", "SpecDecoding"} <= set(
        state["attributes"])


# --- registration (e) -----------------------------------------------------------------------------


def test_register_ascend_customop_mapping_and_caller():
    r = rec("vllm_ascend.utils", "register_ascend_customop")
    assert names(r) == ["vllm_config"]
    base = [d for d in r["dicts"] if d["target"] == "REGISTERED_ASCEND_OPS"]
    assert len(base) == 1
    expected = {
        "RotaryEmbedding": "AscendRotaryEmbedding",
        "RowParallelLinear": "AscendRowParallelLinear",
        "ColumnParallelLinear": "AscendColumnParallelLinear",
        "MergedColumnParallelLinear": "AscendMergedColumnParallelLinear",
        "QKVParallelLinear": "AscendQKVParallelLinear",
        "RMSNorm": "AscendRMSNorm",
        "SiluAndMul": "AscendSiluAndMul",
    }
    assert {k: base[0]["entries"][k] for k in expected} == expected
    (p310,) = [d for d in r["dicts"] if d["target"] == "REGISTERED_ASCEND_OPS.update"]
    assert p310["tests"][-1] == "is_310p()" and p310["entries"]["RotaryEmbedding"] == "AscendRotaryEmbedding310"
    assert calls(r, "CustomOp.register_oot")
    (caller,) = calls(rec("vllm_ascend.worker.worker", "NPUWorker.__init__"), "register_ascend_customop")
    assert caller["args"] == ["vllm_config"]


# --- the extractor itself, on a synthetic tree ----------------------------------------------------

MOD_A = '''
import torch_npu

class Foo(Base):
    scale = 2

    def forward(self, x, mode=None, *, flag: bool = True, **kw):
        if mode is None:
            return x
        return torch_npu.npu_thing(x, mode, flag=flag)

    def gone(self, y):
        return y
'''
MOD_B = '''
def helper(a, /, b=2, *rest, c, **kw):
    pass
'''


def _targets():
    T = ext.Target
    return (
        T("pkg.mod_a", "Foo", "class"),
        T("pkg.mod_a", "Foo.forward", "method", branches=True),
        T("pkg.mod_a", "Foo.gone", "the method the control deletes"),
        T("pkg.mod_b", "helper", "module function"),
        T("pkg.mod_b", "missing", "absent function"),
        T("pkg.nowhere", "anything", "absent module"),
    )


def _write_tree(root: pathlib.Path, mod_a: str) -> None:
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod_a.py").write_text(mod_a)
    (root / "pkg" / "mod_b.py").write_text(MOD_B)


def test_extractor_records_a_synthetic_tree(tmp_path):
    _write_tree(tmp_path, MOD_A)
    out = ext.extract_targets(ext.Source(tmp_path), _targets())
    foo = out["pkg.mod_a:Foo"]
    assert foo["kind"] == "class" and foo["bases"] == ["Base"] and foo["methods"] == ["forward", "gone"]
    assert foo["attributes"] == ["scale"]
    fwd = out["pkg.mod_a:Foo.forward"]
    assert fwd["exists"] and fwd["file"] == "pkg/mod_a.py"
    assert [(p["name"], p["kind"], p.get("default")) for p in fwd["params"]] == [
        ("self", "positional_or_keyword", None),
        ("x", "positional_or_keyword", None),
        ("mode", "positional_or_keyword", "None"),
        ("flag", "keyword_only", "True"),
        ("kw", "var_keyword", None),
    ]
    assert fwd["params"][3]["annotation"] == "bool"
    (call,) = fwd["calls"]
    assert (call["func"], call["args"], call["keywords"]) == ("torch_npu.npu_thing", ["x", "mode"], {"flag": "flag"})
    assert call["tests"] == ["not (mode is None)"]  # the early return negates the if for what follows
    assert [b["value"] for b in fwd["branches"]] == ["x", "torch_npu.npu_thing(x, mode, flag=flag)"]
    helper = out["pkg.mod_b:helper"]
    assert [p["kind"] for p in helper["params"]] == [
        "positional_only", "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"]
    assert helper["params"][3]["has_default"] is False
    assert out["pkg.mod_a:Foo.gone"]["exists"] is True
    assert out["pkg.mod_b:missing"]["exists"] is False
    assert out["pkg.mod_b:missing"]["reason"] == "missing not defined at module level"
    assert out["pkg.nowhere:anything"]["reason"] == "module not found"


def test_extractor_control_deleted_method_is_recorded_absent(tmp_path):
    _write_tree(tmp_path, MOD_A)
    before = ext.extract_targets(ext.Source(tmp_path), _targets())["pkg.mod_a:Foo.gone"]
    assert before["exists"] is True
    _write_tree(tmp_path, MOD_A.replace("    def gone(self, y):\n        return y\n", ""))
    after = ext.extract_targets(ext.Source(tmp_path), _targets())
    assert after["pkg.mod_a:Foo.gone"]["exists"] is False
    assert "not defined in the body of class Foo" in after["pkg.mod_a:Foo.gone"]["reason"]
    assert after["pkg.mod_a:Foo.forward"]["exists"] is True


def test_reextracting_the_wheel_reproduces_the_committed_json():
    wheels = [w for w in glob.glob(str(WHEEL_DIR / "vllm_ascend-0.23.0-*.whl"))
              if pathlib.Path(w).name == CONTRACT["source"]["name"]]
    if not wheels:
        pytest.fail(f"{CONTRACT['source']['name']} not in {WHEEL_DIR}; fetch it with: {DOWNLOAD}")
    if CONTRACT["python"] != f"{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"contract was written by Python {CONTRACT['python']}; ast.unparse text may differ")
    fresh = ext.build_contract(wheels[0])
    assert fresh["source"]["sha256"] == CONTRACT["source"]["sha256"]
    assert ext.dumps(fresh) == CONTRACT_FILE.read_text()
