"""Extracts the vllm-ascend 0.23.0 API a rollout_ext 0.23 binding relies on, by reading its source.

This is a static contract: the wheel is read as a zip and every module is parsed with `ast`; nothing
is imported or installed (vllm-ascend needs torch_npu and CANN). For each entry of TARGETS below it
records whether the class, method or function exists, its parameters in order (kind, annotation,
default), the torch_npu / torch.ops / tracked helper calls in its body with their arguments and the
if-tests that lead to each call, and, where a target asks for it, its return branches, chosen
assignments and dict literals; a class's record also lists the `self.X` its own __init__ assigns. A
`modules` section records, for the few modules in MODULES, the names their unconditional top-level
statements bind (assignments, defs/classes, `from X import ...`). A `package` section records the
wheel's own version, its pins and the vLLM versions its code branches on (`vllm_version_is("...")`).

Regenerate (never install the wheel):
    pip download vllm-ascend==0.23.0 --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_34_x86_64 -d .cache/wheels
    python tests/contract/extract_ascend_contract.py .cache/wheels/vllm_ascend-0.23.0-*.whl

Writes tests/contract/vllm_ascend_0.23.0.contract.json (keys sorted, stable between runs of the same
Python minor version; `ast.unparse` text can differ between Python versions). An unpacked directory
(the folder that holds `vllm_ascend/`) is accepted instead of the wheel. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import json
import pathlib
import sys
import zipfile
from dataclasses import dataclass

OUT_PATH = pathlib.Path(__file__).with_name("vllm_ascend_0.23.0.contract.json")
PACKAGE = "vllm_ascend"


@dataclass(frozen=True)
class Target:
    """One thing we rely on. name: "func", "Class", "Class.method", or "call:func" (module-level calls)."""

    module: str
    name: str
    why: str
    branches: bool = False  # record each return with the if-tests leading to it
    assigns: tuple[str, ...] = ()  # record assignments to these names / attributes, with their if-tests
    dicts: bool = False  # record dict literals that are assigned or passed to .update()


T = Target
ROPE = "vllm_ascend.ops.rotary_embedding"
LINEAR = "vllm_ascend.ops.linear"
LINEAR_OP = "vllm_ascend.ops.linear_op"
CUSTOM_OPS = "vllm_ascend.ops.register_custom_ops"
RUNNER = "vllm_ascend.worker.model_runner_v1"
ATTN = "vllm_ascend.attention.attention_v1"
UTILS = "vllm_ascend.utils"

# fmt: off
TARGETS: tuple[Target, ...] = (
    # --- rope -----------------------------------------------------------------------------------
    T(ROPE, "AscendRotaryEmbedding", "the class vLLM's RotaryEmbedding is swapped for (register_oot); we patch it"),
    T(ROPE, "AscendRotaryEmbedding.__init__", "constructor we must keep working; records cos_sin_cache globally"),
    T(ROPE, "AscendRotaryEmbedding.forward_oot", "the method the rope-cache module replaces (positions, query, key, ...)"),
    T(ROPE, "rope_forward_oot", "body behind torch.ops.vllm.npu_rotary_embedding: the per-layer gather we remove"),
    T(ROPE, "set_cos_and_sin", "allocates the per-step _cos/_sin buffers (NPUModelRunner.__init__)"),
    T(ROPE, "update_cos_sin", "fills the per-step _cos/_sin buffers from positions (execute_model, _dummy_run)"),
    T(ROPE, "get_cos_and_sin_slice", "reads the per-step cos/sin slices (only 310P and patched models use it)"),
    T(ROPE, "_record_cos_sin_cache", "keeps the first rope layer's cos_sin_cache, the table update_cos_sin gathers"),
    T(ROPE, "AscendMRotaryEmbedding.forward_oot", "the only npu_mrope user in 0.23.0 (M-RoPE), not the plain path"),
    T("vllm_ascend._310p.ops.rotary_embedding", "_rope_forward_oot",
      "310P rope: the once-per-step cos/sin + npu_apply_rotary_pos_emb path, for contrast"),
    T(CUSTOM_OPS, "call:direct_register_custom_op",
      "torch.ops.vllm.* names and their python impls (npu_rotary_embedding, matmul_and_reduce, ...)"),
    # --- linear / mc2 / flashcomm1 --------------------------------------------------------------
    T(LINEAR, "AscendRowParallelLinear", "the class mc2_ascend wraps: must define __init__ and forward itself"),
    T(LINEAR, "AscendRowParallelLinear.__init__", "o_proj/down_proj constructor; picks custom_op via get_parallel_op"),
    T(LINEAR, "AscendRowParallelLinear.forward", "the forward the mc2 module replaces; takes input_"),
    T(LINEAR, "AscendColumnParallelLinear.forward", "column forward (flashcomm all-gather side)"),
    T(LINEAR, "AscendQKVParallelLinear.forward", "qkv_proj forward (flashcomm all-gather side)"),
    T(LINEAR, "AscendMergedColumnParallelLinear.forward", "gate_up_proj forward (flashcomm / MLP-TP side)"),
    T(LINEAR_OP, "CustomLinearOp.apply", "what layer.forward delegates to; returns output or (output, bias)"),
    T(LINEAR_OP, "CustomRowParallelOp.apply", "row ops' apply (adds the MLP weight-prefetch hook)"),
    T(LINEAR_OP, "MatmulAllreduceRowParallelOp", "vllm-ascend's own mc2 op class"),
    T(LINEAR_OP, "MatmulAllreduceRowParallelOp.apply_impl", "the torch_npu.npu_mm_all_reduce_base call and its args"),
    T(LINEAR_OP, "MatmulAllreduceRowParallelOp.get_hcomm_info", "how it resolves the HCCL comm name (class-level cache)"),
    T(LINEAR_OP, "SequenceRowParallelOp.apply_impl", "flashcomm1 row op: matmul + reduce-scatter"),
    T(LINEAR_OP, "SequenceRowParallelOp.matmul_and_reduce", "flashcomm1 row op body (all-reduce / reduce-scatter / mmrs)"),
    T(LINEAR_OP, "SequenceColumnParallelOp.apply_impl", "flashcomm1 column op: all-gather + matmul"),
    T(LINEAR_OP, "MLPRowParallelOp.apply_impl", "MLP-only TP row op (mlp_tensor_parallel_size)"),
    T(LINEAR_OP, "_get_row_parallel_op", "row op selection and its order of conditions", branches=True),
    T(LINEAR_OP, "_get_column_parallel_op", "column op selection and its order of conditions", branches=True),
    T(LINEAR_OP, "get_parallel_op", "entry point the linear layers call", branches=True),
    T(UTILS, "matmul_allreduce_enable", "mc2 switch: AscendConfig.enable_matmul_allreduce", branches=True),
    T(UTILS, "enable_sp", "flashcomm1 switch: additional_config / VLLM_ASCEND_ENABLE_FLASHCOMM1", branches=True),
    T(UTILS, "mlp_tp_enable", "MLP-TP switch: finegrained_tp_config.mlp_tensor_parallel_size", branches=True),
    T("vllm_ascend.ascend_forward_context", "set_ascend_forward_context",
      "per-step flash_comm_v1_enabled (num_tokens > 1000 for dense) and pad_size",
      assigns=("flash_comm_v1_enabled", "mmrs_fusion", "pad_size")),
    T(CUSTOM_OPS, "_maybe_chunk_residual_impl", "flashcomm1: residual chunked to this rank before RMSNorm"),
    T(CUSTOM_OPS, "_maybe_all_gather_and_maybe_unpad_impl", "flashcomm1: all-gather before column linears"),
    T(CUSTOM_OPS, "_maybe_pad_and_reduce_impl", "flashcomm1: reduce-scatter after the embedding"),
    T("vllm_ascend.ops.vocab_parallel_embedding", "AscendVocabParallelEmbedding._forward_origin",
      "flashcomm1 entry: embedding ends in maybe_pad_and_reduce"),
    # --- norm -----------------------------------------------------------------------------------
    T("vllm_ascend.ops.layernorm", "AscendRMSNorm.forward_oot", "RMSNorm forward (x, residual); flashcomm hooks here"),
    # --- model runner ---------------------------------------------------------------------------
    T(RUNNER, "NPUModelRunner", "the runner class our per-step hooks attach to"),
    T(RUNNER, "NPUModelRunner._model_forward", "per-step model call; we fill per-step state around it"),
    T(RUNNER, "NPUModelRunner.execute_model", "calls update_cos_sin then _model_forward each step"),
    T(RUNNER, "NPUModelRunner._dummy_run", "warm-up / capture path, also calls update_cos_sin"),
    # --- attention ------------------------------------------------------------------------------
    T(ATTN, "AscendAttentionState", "attention states (PrefillNoCache, ChunkedPrefill, ...)"),
    T(ATTN, "AscendAttentionBackendImpl.forward", "attention forward the FAV2 module would wrap"),
    T(ATTN, "AscendAttentionBackendImpl.forward_impl", "dispatch: paged attention (decode) or FIA"),
    T(ATTN, "AscendAttentionBackendImpl.forward_fused_infer_attention", "the prefill path: npu_fused_infer_attention_score"),
    T(ATTN, "AscendAttentionBackendImpl._get_fia_params", "FIA key/value/block_table per attention state"),
    T(ATTN, "AscendAttentionBackendImpl._forward_prefill_no_cache", "a binding must not rely on it (absent)"),
    T("vllm_ascend.device.device_op", "BaseDeviceAdaptor.npu_fused_infer_attention_score",
      "A2/A3 wrapper behind DeviceOperator for the causal prefill call"),
    # --- registration ---------------------------------------------------------------------------
    T(UTILS, "register_ascend_customop", "name -> Ascend class map registered with CustomOp.register_oot", dicts=True),
    T("vllm_ascend.worker.worker", "NPUWorker.__init__", "where register_ascend_customop is called"),
)
# fmt: on

# Modules whose own top-level bindings a binding relies on: module -> why. For each, the record lists
# the names bound by unconditional top-level statements (not inside if/try): assignments, defs and
# classes, and `from X import ...` bindings (X resolved when relative).
MODULES: dict[str, str] = {
    ROPE: "holds the per-step buffers _cos/_sin and the _cos_sin_cache table as module globals",
    RUNNER: "binds update_cos_sin by from-import: swapping this module's global reaches execute_model's call",
}

# Calls recorded inside a target's body: dotted names with these prefixes, or whose last part is here.
CALL_PREFIXES = ("torch_npu.", "torch.ops.", "DeviceOperator.", "device_utils.")
TRACKED_CALLS = frozenset({
    "update_cos_sin", "set_cos_and_sin", "get_cos_and_sin_slice", "rope_forward_triton",
    "_record_cos_sin_cache", "_record_cos_and_sin_cache_interleaved", "_rope_forward_oot",
    "get_parallel_op", "_get_row_parallel_op", "_get_column_parallel_op", "get_hcomm_info",
    "get_input_parallel", "apply_impl", "matmul_and_reduce", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_reduce_scatter", "tensor_model_parallel_all_gather", "all_gather",
    "reduce_scatter", "all_to_all_single", "get_hccl_comm_name",
    "_model_forward", "set_ascend_forward_context", "_all_gather_hidden_states_and_aux",
    "register_ascend_customop", "init_ascend_config", "register_oot",
    "forward_impl", "forward_fused_infer_attention", "forward_paged_attention", "_get_fia_params",
    "reshape_and_cache", "using_paged_attention", "full_graph_fia", "full_graph_fia_v2", "full_graph_pa",
    "_forward_encoder_attention",
    "enable_sp", "matmul_allreduce_enable", "mlp_tp_enable", "oproj_tp_enable", "flashcomm2_enable",
    "enable_custom_op", "vllm_version_is", "is_310p", "direct_register_custom_op",
})


class Source:
    """Read-only view of a wheel (zip) or of a directory holding the package folder."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        if self.path.is_file():
            self._zip = zipfile.ZipFile(self.path)
            self.names = sorted(n for n in self._zip.namelist() if not n.endswith("/"))
            self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        elif self.path.is_dir():
            self._zip = None
            self.names = sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())
            self.sha256 = None
        else:
            raise FileNotFoundError(f"{path}: neither a wheel nor a directory")
        self._known = set(self.names)

    def read(self, rel: str) -> str | None:
        if rel not in self._known:
            return None
        data = self._zip.read(rel) if self._zip is not None else (self.path / rel).read_bytes()
        return data.decode("utf-8")

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel in self._known:
                return rel
        return None


def _unparse(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _params(args: ast.arguments) -> list[dict]:
    out = []

    def add(arg: ast.arg, kind: str, default: ast.AST | None = None) -> None:
        rec = {"name": arg.arg, "kind": kind, "annotation": _unparse(arg.annotation), "has_default": default is not None}
        if default is not None:
            rec["default"] = _unparse(default)
        out.append(rec)

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        add(arg, "positional_only" if i < len(args.posonlyargs) else "positional_or_keyword", default)
    if args.vararg is not None:
        add(args.vararg, "var_positional")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        add(arg, "keyword_only", default)
    if args.kwarg is not None:
        add(args.kwarg, "var_keyword")
    return out


def _always_exits(stmts: list[ast.stmt]) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Raise))


class _BodyScanner:
    """Walks statements keeping the chain of if-tests (and early-return negations) that lead to each node."""

    def __init__(self, target: Target | None, match):
        self.target = target
        self.match = match
        self.calls: list[dict] = []
        self.returns: list[dict] = []
        self.assigns: list[dict] = []
        self.dicts: list[dict] = []

    def stmts(self, stmts: list[ast.stmt], tests: list[str]) -> None:
        tests = list(tests)
        for stmt in stmts:
            self.node(stmt, tests)
            if isinstance(stmt, ast.If) and not stmt.orelse and _always_exits(stmt.body):
                tests.append(f"not ({_unparse(stmt.test)})")

    def node(self, node: ast.AST, tests: list[str]) -> None:
        t = self.target
        if isinstance(node, ast.If):
            self.node(node.test, tests)
            test = _unparse(node.test)
            self.stmts(node.body, tests + [test])
            self.stmts(node.orelse, tests + [f"not ({test})"])
            return
        if isinstance(node, (ast.For, ast.AsyncFor)):
            self.node(node.iter, tests)
            self.stmts(node.body, tests + [f"for {_unparse(node.target)} in {_unparse(node.iter)}"])
            self.stmts(node.orelse, tests)
            return
        if isinstance(node, ast.Return) and t is not None and t.branches:
            self.returns.append({"lineno": node.lineno, "tests": list(tests), "value": _unparse(node.value)})
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for tgt in targets:
                for leaf in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt]):
                    name = leaf.id if isinstance(leaf, ast.Name) else getattr(leaf, "attr", None)
                    if t is not None and name in t.assigns:
                        self.assigns.append({"lineno": node.lineno, "target": _unparse(leaf),
                                             "tests": list(tests), "value": _unparse(node.value)})
                if t is not None and t.dicts and isinstance(node.value, ast.Dict):
                    self._dict(_unparse(tgt), node.value, node.lineno, tests)
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func is None and isinstance(node.func, ast.Attribute):
                func = _unparse(node.func)  # e.g. group._get_backend(dev).get_hccl_comm_name: matched on its last part
            if func is not None and self.match(func):
                self.calls.append({
                    "func": func,
                    "lineno": node.lineno,
                    "args": [_unparse(a) for a in node.args],
                    "keywords": {(k.arg if k.arg is not None else "**"): _unparse(k.value) for k in node.keywords},
                    "tests": list(tests),
                })
            if (t is not None and t.dicts and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                    and node.args and isinstance(node.args[0], ast.Dict)):
                self._dict(f"{_unparse(node.func.value)}.update", node.args[0], node.lineno, tests)
        for _field, value in ast.iter_fields(node):
            if isinstance(value, list):
                if value and all(isinstance(v, ast.stmt) for v in value):
                    self.stmts(value, tests)
                else:
                    for item in value:
                        if isinstance(item, ast.AST):
                            self.node(item, tests)
            elif isinstance(value, ast.AST):
                self.node(value, tests)

    def _dict(self, target: str, node: ast.Dict, lineno: int, tests: list[str]) -> None:
        entries = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                name = "**"
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                name = key.value
            else:
                name = _unparse(key)
            entries[name] = _unparse(value)
        self.dicts.append({"lineno": lineno, "target": target, "tests": list(tests), "entries": entries})


def _default_match(func: str) -> bool:
    return func.startswith(CALL_PREFIXES) or func.rsplit(".", 1)[-1] in TRACKED_CALLS


def _find_toplevel(body: list[ast.stmt], name: str) -> tuple[ast.AST | None, list[str]]:
    """Last definition of name in a module or class body, looking into if/try blocks (not into defs)."""
    found, guard = None, []

    def visit(stmts: list[ast.stmt], tests: list[str]) -> None:
        nonlocal found, guard
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                found, guard = stmt, tests
            elif isinstance(stmt, ast.If):
                visit(stmt.body, tests + [_unparse(stmt.test)])
                visit(stmt.orelse, tests + [f"not ({_unparse(stmt.test)})"])
            elif isinstance(stmt, ast.Try):
                visit(stmt.body, tests)
                for handler in stmt.handlers:
                    visit(handler.body, tests + [f"except {_unparse(handler.type)}"])
                visit(stmt.orelse, tests)
                visit(stmt.finalbody, tests)

    visit(body, [])
    return found, guard


def _record_def(node: ast.FunctionDef | ast.AsyncFunctionDef, target: Target, kind: str) -> dict:
    scanner = _BodyScanner(target, _default_match)
    scanner.stmts(node.body, [])
    rec = {
        "exists": True,
        "kind": kind,
        "lineno": node.lineno,
        "async": isinstance(node, ast.AsyncFunctionDef),
        "decorators": [_unparse(d) for d in node.decorator_list],
        "params": _params(node.args),
        "returns_annotation": _unparse(node.returns),
        "calls": scanner.calls,
    }
    if target.branches:
        rec["branches"] = scanner.returns
    if target.assigns:
        rec["assigns"] = scanner.assigns
    if target.dicts:
        rec["dicts"] = scanner.dicts
    return rec


def _assigned_leaves(stmt: ast.stmt) -> list[ast.expr]:
    """The leaf targets a binding assignment writes (tuple/list targets unpacked); none for a bare annotation."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
        targets = [stmt.target]
    else:
        return []
    leaves: list[ast.expr] = []
    todo = list(targets)
    while todo:
        tgt = todo.pop(0)
        if isinstance(tgt, (ast.Tuple, ast.List)):
            todo[:0] = tgt.elts
        elif isinstance(tgt, ast.Starred):
            todo.insert(0, tgt.value)
        else:
            leaves.append(tgt)
    return leaves


def _self_attributes(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Names X of every `self.X = ...` in a method's own body (any depth, not in nested defs/classes)."""
    found: set[str] = set()
    todo: list[ast.AST] = list(func.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.stmt):
            for leaf in _assigned_leaves(node):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    found.add(leaf.attr)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found)


def _record_class(node: ast.ClassDef) -> dict:
    methods, attributes = set(), set()
    init_self: list[str] = []
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods.add(stmt.name)
            if stmt.name == "__init__":
                init_self = _self_attributes(stmt)  # the last definition wins, as in the class
        elif isinstance(stmt, ast.Assign):
            attributes.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            attributes.add(stmt.target.id)
    return {
        "exists": True,
        "kind": "class",
        "lineno": node.lineno,
        "bases": [_unparse(b) for b in node.bases],
        "methods": sorted(methods),
        "attributes": sorted(attributes),
        "init_self_attributes": init_self,  # self.X assigned in the class's own __init__ ([] if none)
    }


def extract_target(source: Source, target: Target, _trees: dict | None = None) -> dict:
    """The record of one target. Absent things say so, with the reason."""
    trees = _trees if _trees is not None else {}
    rel = source.module_file(target.module)
    base = {"why": target.why, "module": target.module, "file": rel}
    if rel is None:
        return {**base, "exists": False, "reason": "module not found"}
    if rel not in trees:
        trees[rel] = ast.parse(source.read(rel), filename=rel)
    tree = trees[rel]

    if target.name.startswith("call:"):
        wanted = target.name[len("call:"):]
        scanner = _BodyScanner(None, lambda func: func == wanted or func.endswith("." + wanted))
        for stmt in tree.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scanner.stmts([stmt], [])
        if not scanner.calls:
            return {**base, "exists": False, "reason": f"no module-level call to {wanted}"}
        return {**base, "exists": True, "kind": "module_calls", "calls": scanner.calls}

    head, _, member = target.name.partition(".")
    node, guard = _find_toplevel(tree.body, head)
    if node is None:
        return {**base, "exists": False, "reason": f"{head} not defined at module level"}
    if guard:
        base["guard"] = guard
    if not member:
        if isinstance(node, ast.ClassDef):
            return {**base, **_record_class(node)}
        return {**base, **_record_def(node, target, "function")}
    if not isinstance(node, ast.ClassDef):
        return {**base, "exists": False, "reason": f"{head} is not a class"}
    method, method_guard = _find_toplevel(node.body, member)
    if method is None or isinstance(method, ast.ClassDef):
        return {**base, "exists": False, "reason": f"{member} not defined in the body of class {head}"}
    if method_guard:
        base["guard"] = guard + method_guard
    return {**base, **_record_def(method, target, "method")}


def extract_targets(source: Source, targets: tuple[Target, ...] = TARGETS) -> dict:
    """{"module:name": record} for every target; the parsing function the tests exercise."""
    trees: dict = {}
    out = {}
    for target in targets:
        key = f"{target.module}:{target.name}"
        if key in out:
            raise ValueError(f"duplicate target {key}")
        out[key] = extract_target(source, target, trees)
    return out


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def extract_module(source: Source, module: str, why: str, _trees: dict | None = None) -> dict:
    """Names bound by `module`'s unconditional top-level statements (if/try blocks are not looked into:
    a name bound only conditionally is not listed): `assigned` (=, annotated = value, op=), `defined`
    (def, class) and `from_imports` (source module -> bound names, "a as b" when renamed; `*` kept)."""
    trees = _trees if _trees is not None else {}
    rel = source.module_file(module)
    base = {"why": why, "module": module, "file": rel}
    if rel is None:
        return {**base, "exists": False, "reason": "module not found"}
    if rel not in trees:
        trees[rel] = ast.parse(source.read(rel), filename=rel)
    assigned: set[str] = set()
    defined: set[str] = set()
    imports: dict[str, set[str]] = {}
    for stmt in trees[rel].body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(stmt.name)
        elif isinstance(stmt, ast.ImportFrom):
            src = _resolve_from(module, rel.endswith("/__init__.py"), stmt)
            names = imports.setdefault(src, set())
            for alias in stmt.names:
                names.add(alias.name if alias.asname in (None, alias.name) else f"{alias.name} as {alias.asname}")
        else:
            assigned.update(leaf.id for leaf in _assigned_leaves(stmt) if isinstance(leaf, ast.Name))
    return {
        **base,
        "exists": True,
        "assigned": sorted(assigned),
        "defined": sorted(defined),
        "from_imports": {src: sorted(names) for src, names in sorted(imports.items())},
    }


def extract_modules(source: Source, modules: dict[str, str] = MODULES) -> dict:
    trees: dict = {}
    return {module: extract_module(source, module, why, trees) for module, why in sorted(modules.items())}


def _assigned_constants(text: str | None, names: tuple[str, ...]) -> dict:
    found = {}
    if text is None:
        return found
    for stmt in ast.parse(text).body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            for tgt in stmt.targets:
                if isinstance(tgt, ast.Name) and tgt.id in names:
                    found[tgt.id] = stmt.value.value
    return found


def package_info(source: Source, package: str = PACKAGE) -> dict:
    """Version facts: _version.py, _build_info.py, dist-info METADATA / entry points, vllm_version_is()."""
    info: dict = {
        "version_py": _assigned_constants(source.read(f"{package}/_version.py"), ("__version__", "__commit_id__")),
        "build_info_py": _assigned_constants(source.read(f"{package}/_build_info.py"),
                                             ("__device_type__", "__soc_version__")),
    }
    dist = sorted(n for n in source.names if n.endswith(".dist-info/METADATA") and "/" not in n[:-len("/METADATA")])
    if dist:
        meta = source.read(dist[0])
        headers = meta.split("\n\n", 1)[0].splitlines()
        info["metadata"] = {
            "name": next((h.split(":", 1)[1].strip() for h in headers if h.startswith("Name:")), None),
            "version": next((h.split(":", 1)[1].strip() for h in headers if h.startswith("Version:")), None),
            "requires_python": next((h.split(":", 1)[1].strip() for h in headers if h.startswith("Requires-Python:")),
                                    None),
            "requires_dist": sorted(h.split(":", 1)[1].strip() for h in headers if h.startswith("Requires-Dist:")),
        }
        entry_points = source.read(dist[0].replace("/METADATA", "/entry_points.txt"))
        groups: dict = {}
        group = None
        for line in (entry_points or "").splitlines():
            line = line.strip()
            if line.startswith("[") and line.endswith("]"):
                group = groups.setdefault(line[1:-1], {})
            elif "=" in line and group is not None:
                key, value = line.split("=", 1)
                group[key.strip()] = value.strip()
        info["entry_points"] = groups
    counts: collections.Counter = collections.Counter()
    unparsable = []
    for rel in source.names:
        if not (rel.startswith(f"{package}/") and rel.endswith(".py")):
            continue
        try:
            tree = ast.parse(source.read(rel), filename=rel)
        except (SyntaxError, UnicodeDecodeError):
            unparsable.append(rel)
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and (_dotted(node.func) or "").rsplit(".", 1)[-1] == "vllm_version_is"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                counts[str(node.args[0].value)] += 1
    info["vllm_version_is_calls"] = dict(sorted(counts.items()))
    info["unparsable_files"] = unparsable
    return info


def build_contract(path: str | pathlib.Path, targets: tuple[Target, ...] = TARGETS, package: str = PACKAGE,
                   modules: dict[str, str] = MODULES) -> dict:
    source = Source(path)
    return {
        "modules": extract_modules(source, modules),
        "generator": "tests/contract/extract_ascend_contract.py",
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "source": {"name": source.path.name, "sha256": source.sha256},
        "package": package_info(source, package),
        "targets": extract_targets(source, targets),
    }


def dumps(contract: dict) -> str:
    return json.dumps(contract, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="vllm_ascend-0.23.0-*.whl, or a directory holding vllm_ascend/")
    parser.add_argument("--out", default=str(OUT_PATH), help=f"output JSON (default {OUT_PATH.name})")
    args = parser.parse_args(argv)
    contract = build_contract(args.source)
    pathlib.Path(args.out).write_text(dumps(contract))
    absent = sorted(k for k, v in contract["targets"].items() if not v["exists"])
    print(f"wrote {args.out}: {len(contract['targets'])} targets, {len(contract['modules'])} modules, "
          f"absent: {absent or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
