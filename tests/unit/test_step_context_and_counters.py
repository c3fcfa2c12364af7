"""The two mechanisms every patch shares: the per-step context and the counters."""

from __future__ import annotations

import pytest
import torch

from rollout_ext.patches._context import get_context, reset_context, set_context, step_context
from rollout_ext.patches._counters import Counters, define_op


def test_counters_count_inside_a_captured_graph_where_a_python_count_is_lost():
    """vLLM traces a model once and then calls the captured graph directly, without the Python
    around it: a count must be an op in that graph."""
    define_op()
    counters = Counters("calls")
    python_count = [0]
    graphs = []

    def forward(x):
        counters.add("calls")
        python_count[0] += 1  # control: a Python side effect stays outside the graph
        return x * 2

    def capture(graph, example_inputs):
        graphs.append((graph, example_inputs))  # x, and the counters' tensor lifted as an input
        return graph.forward

    torch.compile(forward, fullgraph=True, backend=capture)(torch.ones(4))  # the trace (one count)
    graph, inputs = graphs[0]
    for _ in range(3):
        graph(*inputs)
    forward(torch.ones(4))  # and once eagerly
    assert counters.read() == {"calls": 5}
    assert python_count[0] == 2  # the trace's replayed side effect and the eager call only
    counters.reset()
    assert counters.read() == {"calls": 0}


def test_counters_name_an_unknown_counter():
    with pytest.raises(ValueError):
        Counters("calls").add("call")


def test_step_context_sets_for_one_forward_and_restores():
    positions = torch.arange(3)
    assert get_context().rope_positions is None
    with step_context(rope_positions=positions) as context:
        assert context.rope_positions is positions
        with step_context(flashcomm_step="plan"):
            assert get_context().rope_positions is positions and get_context().flashcomm_step == "plan"
        assert get_context().flashcomm_step is None
    assert get_context().rope_positions is None
    set_context(rope_positions=positions)
    reset_context()
    assert get_context().rope_positions is None
    with pytest.raises(AttributeError, match="rope_position.*fields: rope_positions, flashcomm_step"):
        set_context(rope_position=positions)
