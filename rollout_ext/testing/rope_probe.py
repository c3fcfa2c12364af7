"""Reads rope gather counters from engine workers (through `LLM.collective_rpc`).

With rope_cache applied the patch counts its own gathers and forwards. Without it, `install` wraps
each rotary module's dispatched forward and the runner's `_model_forward` so that the same counters
count vLLM's own per-layer gathers. That wrapping happens after the engine has started, so it
sees eager forwards only: a compiled graph was traced before and never calls Python rotary code
again (its unpatched count reads 0 gathers and is reported as not measured).
"""

from __future__ import annotations


def _count_calls(original, slot: str):
    from rollout_ext.patches import rope_cache

    def counted(*args, **kwargs):
        rope_cache.COUNTERS.add(slot)
        return original(*args, **kwargs)

    return counted


def install(worker) -> int:
    """Reset the counters; without the patch, count unpatched gathers. Returns modules counted."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from rollout_ext.patches import rope_cache

    rope_cache.COUNTERS.reset()
    if rope_cache.is_applied():
        return 0
    runner = worker.model_runner
    ropes = {id(m): m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)}
    for module in ropes.values():
        module._forward_method = _count_calls(module._forward_method, "layer_gathers")
    runner._model_forward = _count_calls(runner._model_forward, "forwards")
    return len(ropes)


def read(worker) -> dict:
    from rollout_ext.patches import rope_cache

    found = rope_cache.COUNTERS.read()
    found["patched"] = rope_cache.is_applied()
    forwards = found["forwards"]
    gathers = found["step_gathers"] + found["layer_gathers"]
    found["gathers_per_forward"] = gathers / forwards if forwards and gathers else None
    return found
