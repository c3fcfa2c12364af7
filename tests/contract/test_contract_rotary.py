"""Rotary NPU paths (fused op and ATB op) under the emulation equal the reference path."""

import pytest

from contract_emulation import run_scenario


@pytest.mark.parametrize("case", ["fused_then_two_tables", "neox_head80", "neox_partial", "gptj_partial"])
def test_contract_rotary_npu_path_matches_reference(case):
    output = run_scenario("rotary_scenario.py", case)
    assert "ok" in output
