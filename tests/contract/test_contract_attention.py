"""ATB flash attention path under the emulation equals the reference; mask_type and seq_len checked."""

from contract_emulation import run_scenario


def test_contract_prefill_attention_npu_path_matches_reference():
    output = run_scenario("attention_scenario.py")
    assert "ok controls" in output
