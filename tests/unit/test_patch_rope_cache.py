"""rope_cache: applies idempotently, reverts exactly, its guards trip, and patched rope equals vLLM's
rope bit for bit in fp32 (neox, GPT-J, partial rotary, two tables in one process), eager and
compiled, with the gather counter reading 1 per forward where unpatched layers gather N times."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from rollout_ext.config import ExtConfig
from rollout_ext.patches import PatchError
from rollout_ext.patches import rope_cache

import vllm.model_executor.layers.rotary_embedding as rotary  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

CFG = ExtConfig(rope_cache=True)
NUM_LAYERS = 3
ROWS = 256


@pytest.fixture
def vllm_config():
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def patched(vllm_config):
    rope_cache.apply(CFG)
    yield
    rope_cache.revert()


class Layers(torch.nn.Module):
    """NUM_LAYERS decoder-like calls of shared rotary modules with the same positions tensor."""

    def __init__(self, *ropes):
        super().__init__()
        self.ropes = torch.nn.ModuleList(ropes)

    def forward(self, positions, queries, keys):
        outs = []
        for i, (q, k) in enumerate(zip(queries, keys)):
            rope = self.ropes[i % len(self.ropes)]
            outs.append(rope(positions, q, k))
        return outs


def reference(rope, positions, q, k):
    return RotaryEmbedding.forward_static(
        positions, q, k, rope.head_size, rope.rotary_dim, rope.cos_sin_cache, rope.is_neox_style
    )


def make_rope(head_size, rotary_dim, is_neox, base, max_position):
    # max_position differs per case so that get_rope's instance cache never returns an old module.
    return rotary.get_rope(
        head_size, max_position, is_neox_style=is_neox,
        rope_parameters={"rope_theta": base, "partial_rotary_factor": rotary_dim / head_size},
        dtype=torch.float32,
    )


def inputs(num_tokens, head_size, max_position, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    queries = [torch.randn(num_tokens, 4 * head_size, generator=g) for _ in range(NUM_LAYERS)]
    keys = [torch.randn(num_tokens, 2 * head_size, generator=g) for _ in range(NUM_LAYERS)]
    return positions, queries, keys


def test_apply_is_idempotent_and_revert_restores_originals(vllm_config):
    init, model_forward = RotaryEmbedding.__init__, GPUModelRunner._model_forward
    compute_hash = VllmConfig.compute_hash
    assert "forward" not in RotaryEmbedding.__dict__
    rope_cache.apply(CFG)
    try:
        patched = (RotaryEmbedding.forward, RotaryEmbedding.__init__, GPUModelRunner._model_forward)
        assert RotaryEmbedding.forward is rope_cache.rope_forward
        assert RotaryEmbedding.__init__ is not init and GPUModelRunner._model_forward is not model_forward
        assert VllmConfig.compute_hash is not compute_hash
        rope_cache.apply(CFG)
        assert (RotaryEmbedding.forward, RotaryEmbedding.__init__, GPUModelRunner._model_forward) == patched
    finally:
        rope_cache.revert()
    assert "forward" not in RotaryEmbedding.__dict__
    assert RotaryEmbedding.__init__ is init
    assert GPUModelRunner._model_forward is model_forward
    assert VllmConfig.compute_hash is compute_hash
    rope_cache.revert()  # a second revert changes nothing
    assert RotaryEmbedding.__init__ is init


def test_version_guard_names_the_patch(monkeypatch, vllm_config):
    monkeypatch.setattr("rollout_ext.patches._base.vllm_version", lambda: Version("0.30.0"))
    with pytest.raises(PatchError, match="rope_cache"):
        rope_cache.apply(CFG)
    assert "forward" not in RotaryEmbedding.__dict__


def test_signature_guard_trips_when_upstream_moved():
    class MovedRope(RotaryEmbedding):
        def forward_native(self, query, key, positions):
            raise AssertionError

    class MovedRunner(GPUModelRunner):
        def _model_forward(self, positions, input_ids=None):
            raise AssertionError

    with pytest.raises(PatchError, match="rope_cache.*forward_native"):
        rope_cache.check_upstream(MovedRope, GPUModelRunner)
    with pytest.raises(PatchError, match="rope_cache.*_model_forward"):
        rope_cache.check_upstream(RotaryEmbedding, MovedRunner)
    rope_cache.check_upstream(RotaryEmbedding, GPUModelRunner)


CASES = {
    "neox": (64, 64, True, 1e4, 4101),
    "gptj": (64, 64, False, 1e4, 4102),
    "partial_neox": (64, 32, True, 5e5, 4103),
    "partial_gptj": (128, 64, False, 1e6, 4104),
}


@pytest.mark.parametrize("case", list(CASES))
def test_patched_rope_equals_vllm_bit_for_bit_with_one_gather(patched, case):
    head_size, rotary_dim, is_neox, base, max_position = CASES[case]
    rope = make_rope(head_size, rotary_dim, is_neox, base, max_position)
    assert type(rope).forward is rope_cache.rope_forward
    assert getattr(rope, rope_cache.STEP_BUFFER) is not None  # attached by the wrapped __init__
    model = Layers(rope)
    positions, queries, keys = inputs(37, head_size, max_position)

    rope_cache.COUNTERS.reset()
    with rope_cache.rope_step(model, positions):
        outs = model(positions, queries, keys)
    assert rope_cache.COUNTERS.read() == {"step_gathers": 1, "layer_gathers": 0, "forwards": 1}
    for (q, k), (q_ref, k_ref) in zip(outs, (reference(rope, positions, q, k) for q, k in zip(queries, keys))):
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)

    # Unpatched path, counted by the same counter: outside a step every layer gathers for itself.
    rope_cache.COUNTERS.reset()
    fallback = model(positions, queries, keys)
    assert rope_cache.COUNTERS.read()["layer_gathers"] == NUM_LAYERS
    for (q, k), (q_ref, k_ref) in zip(fallback, outs):
        torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-5)  # vLLM's CPU kernel vs native math
        torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-5)


def test_two_tables_in_one_process_never_share_a_gather(patched):
    rope_a = make_rope(64, 64, True, 1e4, 4201)
    rope_b = make_rope(64, 32, False, 5e5, 4202)
    model = Layers(rope_a, rope_b)
    positions, queries, keys = inputs(29, 64, 4201, seed=1)
    rope_cache.COUNTERS.reset()
    with rope_cache.rope_step(model, positions):
        outs = model(positions, queries, keys)
    assert rope_cache.COUNTERS.read()["step_gathers"] == 2
    assert rope_cache.COUNTERS.read()["layer_gathers"] == 0
    for i, ((q, k), q_in, k_in) in enumerate(zip(outs, queries, keys)):
        rope = (rope_a, rope_b)[i % 2]
        q_ref, k_ref = reference(rope, positions, q_in, k_in)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_other_positions_fall_back_in_eager(patched):
    rope = make_rope(64, 64, True, 1e4, 4301)
    model = Layers(rope)
    positions, queries, keys = inputs(11, 64, 4301, seed=2)
    other = positions.flip(0)
    rope_cache.COUNTERS.reset()
    with rope_cache.rope_step(model, positions):
        q, k = rope(other, queries[0], keys[0])  # not the step's positions: must not use its rows
    assert rope_cache.COUNTERS.read()["layer_gathers"] == 1
    q_ref, k_ref = reference(rope, other, queries[0], keys[0])
    torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-5)


def test_compiled_graph_reads_the_step_buffer_at_run_time(patched):
    rope = make_rope(64, 32, True, 1e4, 4401)
    model = Layers(rope)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for seed, num_tokens in ((3, 17), (4, 17), (5, 23)):
        positions, queries, keys = inputs(num_tokens, 64, 4401, seed=seed)
        rope_cache.COUNTERS.reset()
        with rope_cache.rope_step(model, positions):
            outs = compiled(positions, queries, keys)
        assert rope_cache.COUNTERS.read() == {"step_gathers": 1, "layer_gathers": 0, "forwards": 1}
        for (q, k), q_in, k_in in zip(outs, queries, keys):
            q_ref, k_ref = reference(rope, positions, q_in, k_in)
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_counter_counts_inside_compiled_code(patched):
    rope = make_rope(64, 64, False, 1e4, 4501)
    delattr(rope, rope_cache.STEP_BUFFER)  # no step buffer: every layer gathers for itself
    model = Layers(rope)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    positions, queries, keys = inputs(9, 64, 4501, seed=6)
    compiled(positions, queries, keys)
    rope_cache.COUNTERS.reset()
    compiled(positions, queries, keys)
    compiled(positions, queries, keys)
    assert rope_cache.COUNTERS.read()["layer_gathers"] == 2 * NUM_LAYERS


def test_subclass_with_other_math_is_left_alone(patched):
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    assert not rope_cache.eligible(object())
    assert DeepseekScalingRotaryEmbedding.forward_native is not RotaryEmbedding.forward_native
    rope = make_rope(64, 64, True, 1e4, 4601)
    assert rope_cache.eligible(rope)


def test_no_vllm_config_means_no_step_buffer():
    rope_cache.apply(CFG)
    try:
        with set_current_vllm_config(VllmConfig()):
            rope = make_rope(64, 64, True, 1e4, 4701)
        assert getattr(rope, rope_cache.STEP_BUFFER, None) is not None
        assert rope_cache._step_rows() is None  # outside a config context nothing is attached
    finally:
        rope_cache.revert()
