"""Fused matmul+all-reduce under the emulation: 2 gloo ranks, bias on rank 0, hcom per group."""

from contract_emulation import run_scenario

from rollout_ext.testing.dist import free_port


def test_contract_mm_all_reduce_two_ranks_two_groups():
    output = run_scenario("linear_scenario.py", str(free_port()), timeout_s=120)
    assert "rank 0: ok" in output and "rank 1: ok" in output
