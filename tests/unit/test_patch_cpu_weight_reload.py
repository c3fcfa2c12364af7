"""cpu_weight_reload on real vLLM (CPU): a linear layer keeps a weight that verl's sync can load into."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from rollout_ext.config import ExtConfig
from rollout_ext.patches import cpu_weight_reload
from rollout_ext.testing.dist import free_port, vllm_tp_group


def _loaded_layer() -> torch.nn.Module:
    """A linear layer as vLLM's loader leaves it: weights created by the method, loaded, processed."""
    layer = torch.nn.Module()
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.create_weights(layer, 64, [32], 64, 32, torch.float32, weight_loader=default_weight_loader)
    layer.weight.weight_loader(layer.weight, torch.randn(32, 64))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_synced_cpu_replica_keeps_a_reloadable_weight():
    with vllm_tp_group(0, free_port(), world_size=1):
        # Control: vLLM's own CPU path drops the weight, and a reload then fails as verl's sync does.
        stock = _loaded_layer()
        assert stock.weight.numel() == 0 and not hasattr(stock.weight, "weight_loader")

        assert cpu_weight_reload.apply(ExtConfig.from_env({"ROLLOUT_EXT_WEIGHT_SYNC": "1"})) == "active"
        try:
            layer = _loaded_layer()
            assert layer.weight.shape == (32, 64) and hasattr(layer.weight, "weight_loader")
            x = torch.randn(3, 64)
            new = torch.randn(32, 64)
            layer.weight.weight_loader(layer.weight, new)  # what verl's load_weights does per tensor
            layer.quant_method.process_weights_after_loading(layer)  # verl re-runs it after the sync
            out = layer.quant_method.apply(layer, x)
            torch.testing.assert_close(out, x @ new.T, rtol=1e-4, atol=1e-4)
        finally:
            cpu_weight_reload.revert()
    assert "cpu_weight_reload" not in UnquantizedLinearMethod.process_weights_after_loading.__module__


def test_not_applied_without_weight_sync():
    assert cpu_weight_reload.apply(ExtConfig.from_env({})) == "inert"
    assert not hasattr(UnquantizedLinearMethod.process_weights_after_loading, "__wrapped__")
