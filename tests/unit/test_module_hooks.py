"""Each module record lists every attribute its patch swaps (the audit: tests/unit/hook_audit.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hook_audit import run as audit  # noqa: E402


def test_every_swap_on_stock_vllm_is_in_the_record_and_an_unlisted_one_fails():
    report = audit()
    assert {name: entry["unlisted"] for name, entry in report.items() if entry["unlisted"]} == {}
    # The audit sees the swaps: every patch that binds here swaps something, fav2 refuses and swaps nothing.
    assert all(entry["swapped"] for name, entry in report.items() if name != "fav2"), report
    assert report["fav2"]["swapped"] == [] and "NPU-only" in report["fav2"]["refused"]
    # flashcomm's embedding wrapper, the swap its record once lacked, is among them.
    assert "vllm.model_executor.models.qwen2.Qwen2Model.embed_input_ids" in report["flashcomm"]["swapped"]
    # Control: one more attribute swapped during rope_cache's apply is reported unlisted.
    control = audit("--unlisted-swap")
    assert control["rope_cache"]["unlisted"] == ["vllm.model_executor.layers.linear.RowParallelLinear.extra_repr"]
