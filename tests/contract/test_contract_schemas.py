"""The vendored torch_npu 2.14 schemas parse, and the emulation's binder enforces them."""

import importlib.util
import pathlib
import re

import pytest
import torch

from contract_emulation import EMU_DIR, run_scenario

SCHEMA_FILE = pathlib.Path(__file__).with_name("torch_npu_2.14.schemas")
CALLED_OPS = {
    "npu_apply_rotary_pos_emb",
    "npu_mm_all_reduce_base",
    "_npu_rotary_embedding",
    "_npu_flash_attention_v2",
    # Called by vllm-ascend's own layers; emulated for the Ascend-on-CPU lane (tests/ascend).
    "npu_mrope",
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
}


def load_binder():
    """The binder module by file path, so this process never imports the emulated torch_npu."""
    spec = importlib.util.spec_from_file_location("emu_schema", EMU_DIR / "torch_npu" / "_schema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_contract_header_names_wheel_and_sha256():
    header = SCHEMA_FILE.read_text().splitlines()[:2]
    assert re.fullmatch(r"# wheel: torch_npu-2\.14\.0-cp311-cp311-manylinux\S+\.whl", header[0])
    assert re.fullmatch(r"# sha256: [0-9a-f]{64}", header[1])


def test_contract_every_schema_parses():
    lines = [ln for ln in SCHEMA_FILE.read_text().splitlines() if ln and not ln.startswith("#")]
    names = {torch._C.parse_schema(line).name for line in lines}
    assert names == CALLED_OPS


def test_contract_binder_accepts_our_call_shapes():
    binder = load_binder()
    t = torch.zeros(1)
    bound = binder.bind("npu_mm_all_reduce_base", (t, t, "comm"), {"reduce_op": "sum", "bias": None})
    assert bound["comm_turn"] == 0 and bound["bias"] is None
    bound = binder.bind("npu_apply_rotary_pos_emb", (t, t, t, t), {"layout": "BSND", "rotary_mode": "half"})
    assert bound["layout"] == "BSND"
    binder.bind("_npu_rotary_embedding", (t, t, t, 64, t, True), {})
    bound = binder.bind(
        "_npu_flash_attention_v2", (t, t, t, [3, 4]),
        {"mask": t, "mask_type": 1, "scale_value": 0.1, "num_heads": 4, "num_kv_heads": 2, "out": t},
    )
    assert bound["kernel_type"] == 0 and bound["slopes"] is None


@pytest.mark.parametrize(
    "op, args, kwargs, message",
    [
        ("npu_mm_all_reduce_base", ("x", "w", "c"), {}, "must be Tensor"),
        ("npu_mm_all_reduce_base", (0, 0, "c", "sum"), {}, "positional"),
        ("npu_mm_all_reduce_base", (0, 0, "c"), {"world_size": 2}, "unexpected keyword"),
        ("npu_mm_all_reduce_base", (0, 0), {}, "missing required"),
        ("_npu_flash_attention_v2", (0, 0, 0, [1]), {}, "missing required argument 'out'"),
        ("_npu_flash_attention_v2", (0, 0, 0, "seq"), {"out": 0}, "seq_len"),
        ("_npu_rotary_embedding", (0, 0, 0, 64, 0), {"is_neox": True}, "unexpected keyword"),
        ("npu_apply_rotary_pos_emb", (0, 0, 0, 0), {"query": 0}, "multiple values"),
    ],
)
def test_contract_binder_rejects_misuse(op, args, kwargs, message):
    binder = load_binder()
    t = torch.zeros(1)
    args = tuple(t if a == 0 else a for a in args)
    kwargs = {k: (t if v == 0 and not isinstance(v, bool) else v) for k, v in kwargs.items()}
    with pytest.raises(TypeError, match=message):
        binder.bind(op, args, kwargs)


def test_contract_ops_import_without_torch_npu(tmp_path):
    """Importing rollout_ext.ops never imports torch_npu, even where it is importable."""
    run_scenario("lazy_import_scenario.py")
