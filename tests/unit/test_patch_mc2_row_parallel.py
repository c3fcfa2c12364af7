"""mc2_row_parallel: applies idempotently, reverts exactly, its guards trip, and its dispatch
decides at run time (2 real CPU ranks, eager and torch.compile)."""

from __future__ import annotations

import pytest
from packaging.version import Version

from rollout_ext.config import ExtConfig
from rollout_ext.patches import PatchError
from rollout_ext.patches import mc2_row_parallel as mc2
from rollout_ext.testing.dist import run_ranks

import vllm.model_executor.layers.linear as vllm_linear  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot  # noqa: E402

CFG = ExtConfig(mc2=True, mc2_min_tokens=4)


@pytest.fixture
def reverted():
    yield
    mc2.revert()


def test_apply_is_idempotent_and_revert_restores_originals(reverted):
    original_hash = VllmConfig.compute_hash
    before = op_registry_oot.get(mc2.LAYER_NAME)
    mc2.apply(CFG)
    layer_cls = op_registry_oot[mc2.LAYER_NAME]
    patched_hash = VllmConfig.compute_hash
    assert issubclass(layer_cls, vllm_linear.RowParallelLinear)
    assert patched_hash is not original_hash

    mc2.apply(CFG)
    assert op_registry_oot[mc2.LAYER_NAME] is layer_cls
    assert VllmConfig.compute_hash is patched_hash

    mc2.revert()
    assert op_registry_oot.get(mc2.LAYER_NAME) is before
    assert VllmConfig.compute_hash is original_hash
    mc2.revert()  # a second revert changes nothing
    assert VllmConfig.compute_hash is original_hash


def test_compile_cache_key_changes_with_patch_and_setting(reverted):
    config = VllmConfig()
    off = config.compute_hash()
    mc2.apply(CFG)
    on = config.compute_hash()
    mc2.revert()
    mc2.apply(ExtConfig(mc2=True, mc2_min_tokens=8))
    other = config.compute_hash()
    assert len({off, on, other}) == 3


def test_a_previously_registered_layer_class_is_wrapped_and_restored(reverted):
    class PlatformRowParallelLinear(vllm_linear.RowParallelLinear):
        pass

    op_registry_oot[mc2.LAYER_NAME] = PlatformRowParallelLinear
    try:
        mc2.apply(CFG)
        assert issubclass(op_registry_oot[mc2.LAYER_NAME], PlatformRowParallelLinear)
        mc2.revert()
        assert op_registry_oot[mc2.LAYER_NAME] is PlatformRowParallelLinear
    finally:
        op_registry_oot.pop(mc2.LAYER_NAME, None)


def test_version_guard_names_the_patch(monkeypatch, reverted):
    monkeypatch.setattr("rollout_ext.patches._base.vllm_version", lambda: Version("0.30.0"))
    with pytest.raises(PatchError, match="mc2_row_parallel"):
        mc2.apply(CFG)
    assert mc2.LAYER_NAME not in op_registry_oot


def test_signature_guard_trips_when_forward_moved():
    class MovedRowParallelLinear(vllm_linear.RowParallelLinear):
        def forward(self, hidden_states, residual=None):
            return hidden_states

    with pytest.raises(PatchError, match="mc2_row_parallel.*forward"):
        mc2.check_upstream(MovedRowParallelLinear, PluggableLayer)
    mc2.check_upstream(vllm_linear.RowParallelLinear, PluggableLayer)


def test_signature_guard_trips_when_layer_is_no_longer_pluggable():
    with pytest.raises(PatchError, match="mc2_row_parallel.*PluggableLayer"):
        mc2.check_upstream(vllm_linear.RowParallelLinear, VllmConfig)


def test_dispatch_on_two_ranks_decides_at_run_time(repo_root):
    script = repo_root / "tests/unit/patch_scenarios/mc2_dispatch.py"
    proc = run_ranks(script, repo_root, "mc2-unit", timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout
