"""Extracts the torch_npu op schemas our NPU code calls from a downloaded torch-npu wheel.

Usage (the wheel is never installed: without CANN it breaks `import torch`):
    pip download torch-npu==2.14.0 --no-deps -d /tmp/tnpu --platform manylinux_2_28_x86_64 \
        --python-version 3.11 --only-binary=:all:
    python tests/contract/extract_schemas.py /tmp/tnpu/torch_npu-2.14.0-cp311-...whl

Sources, all inside the wheel except one:
- aclnn ops: printable strings of torch_npu/lib/libtorch_npu.so (the registered schema text).
- _npu_flash_attention_v2: the ATB library stores its schema text in pieces, so we take the
  signature line from the wheel's own torch_npu/op_plugin/atb/_atb_api_docs.py.
- _npu_rotary_embedding: neither place holds it whole. The line is vendored from op-plugin's
  op_plugin/ops/atb/RopeAtb.cpp (TORCH_LIBRARY_FRAGMENT m.def), and the script checks that the
  wheel's libop_plugin_atb.so exports the matching C++ symbol.
Writes tests/contract/torch_npu_2.14.schemas: a header (wheel name, sha256), one schema a line.
"""

import hashlib
import pathlib
import re
import sys
import zipfile

SO_OPS = ("npu_apply_rotary_pos_emb", "npu_mm_all_reduce_base", "npu_mrope", "npu_rms_norm", "npu_add_rms_norm",
          "npu_swiglu")
DOCS_OPS = ("_npu_flash_attention_v2",)

# From github.com/Ascend/op-plugin op_plugin/ops/atb/RopeAtb.cpp (commit 59dc548c1cd7...).
VENDORED = {
    "_npu_rotary_embedding": (
        "_npu_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox_style) -> ()"
    ),
}
# Itanium-mangled atb::_npu_rotary_embedding(Tensor const&, Tensor&, Tensor&, long, Tensor const&, bool)
VENDORED_SYMBOLS = {"_npu_rotary_embedding": b"ZN3atb21_npu_rotary_embeddingERKN2at6TensorERS1_S4_lS3_b"}

OUT_PATH = pathlib.Path(__file__).with_name("torch_npu_2.14.schemas")


def printable_strings(data: bytes, min_len: int = 8):
    for match in re.finditer(rb"[\x20-\x7e]{%d,}" % min_len, data):
        yield match.group(0).decode("ascii")


def schema_from_so(strings: list[str], op: str) -> str:
    pattern = re.compile(r"^%s\(.*\) -> .+$" % re.escape(op))
    found = sorted({s for s in strings if pattern.match(s)})
    if len(found) != 1:
        raise SystemExit(f"{op}: expected one schema string in libtorch_npu.so, found {found}")
    return found[0]


def schema_from_docs(docs: str, op: str) -> str:
    pattern = re.compile(r"^torch_npu\.atb\.(%s\(.*\) -> .+)$" % re.escape(op), re.MULTILINE)
    found = sorted(set(pattern.findall(docs)))
    if len(found) != 1:
        raise SystemExit(f"{op}: expected one signature line in _atb_api_docs.py, found {found}")
    return found[0]


def main(wheel_path: str) -> None:
    wheel = pathlib.Path(wheel_path)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with zipfile.ZipFile(wheel) as archive:
        so_strings = list(printable_strings(archive.read("torch_npu/lib/libtorch_npu.so")))
        docs = archive.read("torch_npu/op_plugin/atb/_atb_api_docs.py").decode("utf-8")
        atb_so = archive.read("torch_npu/lib/libop_plugin_atb.so")
    for op, symbol in VENDORED_SYMBOLS.items():
        if symbol not in atb_so:
            raise SystemExit(f"{op}: C++ symbol not found in libop_plugin_atb.so; re-check the vendored line")
    lines = [
        f"# wheel: {wheel.name}",
        f"# sha256: {digest}",
        "# aclnn ops: strings of torch_npu/lib/libtorch_npu.so",
        "# _npu_flash_attention_v2: torch_npu/op_plugin/atb/_atb_api_docs.py in the same wheel",
        "#   (op-plugin registers it as the .out overload with these same arguments)",
        "# _npu_rotary_embedding: vendored from Ascend/op-plugin op_plugin/ops/atb/RopeAtb.cpp;",
        "#   its C++ symbol was checked present in torch_npu/lib/libop_plugin_atb.so",
    ]
    lines += [schema_from_so(so_strings, op) for op in SO_OPS]
    lines += [schema_from_docs(docs, op) for op in DOCS_OPS]
    lines += list(VENDORED.values())
    OUT_PATH.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT_PATH} ({len(lines)} lines)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
