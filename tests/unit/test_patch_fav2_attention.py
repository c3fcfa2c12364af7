"""fav2_attention: refuses off-NPU; on an emulated NPU it hooks vllm-ascend's prefill path once and reverts.

The NPU case runs in a subprocess with two packages on sys.path: the torch_npu emulation from
tests/contract/emu (the real op schema plus the op's documented math) and a minimal stand-in for
vllm-ascend's attention_v1 module, written into a temporary directory with the method layout the
patch targets. Neither is vLLM; no real NPU kernel runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from rollout_ext.config import ExtConfig
from rollout_ext.ops import npu_available
from rollout_ext.patches import PatchError
from rollout_ext.patches import fav2_attention as patch

CFG = ExtConfig(fav2=True, rope_cache=False)
REPO_ROOT = Path(__file__).resolve().parents[2]
EMU = REPO_ROOT / "tests" / "contract" / "emu"

ASCEND_ATTENTION = '''
class AscendAttentionBackendImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads

    def _forward_prefill_no_cache(self, query, key, value, attn_metadata, output=None, num_tokens=0):
        raise AssertionError("the unpatched prefill path ran")
'''

SCENARIO = '''
import sys, types, torch, torch_npu
from rollout_ext.config import ExtConfig
from rollout_ext.ops.attention import prefill_attention_reference
from rollout_ext.patches import fav2_attention as patch
from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl as Impl

original = Impl.__dict__["_forward_prefill_no_cache"]
cfg = ExtConfig(fav2=True, rope_cache=False)
patch.apply(cfg)
hooked = Impl.__dict__["_forward_prefill_no_cache"]
patch.apply(cfg)
assert Impl.__dict__["_forward_prefill_no_cache"] is hooked is not original

seq_lens = [5, 2, 9]
heads, kv_heads, size = 4, 2, 16
tokens = sum(seq_lens)
gen = torch.Generator().manual_seed(0)
q = torch.randn(tokens, heads, size, generator=gen).half()
k = torch.randn(tokens, kv_heads, size, generator=gen).half()
v = torch.randn(tokens, kv_heads, size, generator=gen).half()
# vllm-ascend pads the output buffer past the real tokens.
out = torch.zeros(tokens + 3, heads, size, dtype=torch.float16)
impl = Impl(heads, size, size ** -0.5, kv_heads)
meta = types.SimpleNamespace(seq_lens=torch.tensor(seq_lens))
before = len(torch_npu.CALLS)
got = impl._forward_prefill_no_cache(q, k, v, meta, out, tokens)
calls = torch_npu.CALLS[before:]
assert [op for op, _ in calls] == ["_npu_flash_attention_v2"], calls
assert calls[0][1]["mask_type"] == 1 and calls[0][1]["seq_len"] == seq_lens, calls[0][1]
want = prefill_attention_reference(q, k, v, seq_lens=seq_lens, scale=size ** -0.5, num_heads=heads,
                                   num_kv_heads=kv_heads, head_size=size)
err = (got.float() - want.float()).abs().max().item()
assert got.shape == (tokens, heads, size) and err < 2e-3, err
assert out[tokens:].abs().max().item() == 0
patch.revert()
assert Impl.__dict__["_forward_prefill_no_cache"] is original
print("ok", err)
'''


def test_refuses_off_npu_naming_patch_and_device():
    if npu_available():
        pytest.skip("torch_npu is importable here")
    with pytest.raises(PatchError, match=r"'fav2_attention': device is cpu, but FAV2 .* is NPU-only"):
        patch.apply(CFG)
    assert not patch._swaps.applied


def test_version_guard_names_the_patch(monkeypatch):
    monkeypatch.setattr("rollout_ext.patches._base.vllm_version", lambda: Version("0.22.0"))
    with pytest.raises(PatchError, match="'fav2_attention' supports vllm>=0.23,<0.28; found vllm 0.22.0"):
        patch.apply(CFG)


def _run(tmp_path, scenario: str, impl_source: str) -> subprocess.CompletedProcess:
    package = tmp_path / "vllm_ascend" / "attention"
    package.mkdir(parents=True)
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "attention_v1.py").write_text(impl_source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(EMU), str(REPO_ROOT)])}
    return subprocess.run([sys.executable, "-c", scenario], capture_output=True, text=True, env=env, timeout=120)


def test_hooks_vllm_ascend_prefill_on_emulated_npu(tmp_path):
    proc = _run(tmp_path, SCENARIO, ASCEND_ATTENTION)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_signature_guard_trips_on_another_ascend_layout(tmp_path):
    moved = ASCEND_ATTENTION.replace("query, key, value, attn_metadata", "query, attn_metadata, key, value")
    scenario = textwrap.dedent('''
        from rollout_ext.config import ExtConfig
        from rollout_ext.patches import PatchError, fav2_attention as patch
        try:
            patch.apply(ExtConfig(fav2=True, rope_cache=False))
        except PatchError as e:
            print("refused:", e)
        assert not patch._swaps.applied
    ''')
    proc = _run(tmp_path, scenario, moved)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: rollout_ext patch 'fav2_attention': AscendAttentionBackendImpl._forward_prefill_no_cache" in proc.stdout
