"""Flashcomm: token-sharded residual stream for Qwen2/Llama under TP (reduce-scatter + all-gather).

What it replaces, for a step with TP > 1 and at least ROLLOUT_EXT_FLASHCOMM_MIN_TOKENS tokens:
- RowParallelLinear (o_proj, down_proj): the all-reduce becomes a REDUCE-SCATTER over tokens,
  padded to a multiple of TP, so each rank keeps 1/TP of the rows;
- the residual add and RMSNorm therefore run on the local token shard (no change to RMSNorm: it
  simply gets fewer rows);
- ColumnParallelLinear (qkv_proj, gate_up_proj): the shard is ALL-GATHERED (and unpadded) first;
- Qwen2Model/LlamaModel.embed_input_ids: the embedding output is padded and sharded at model
  start; the model's output (after the final norm, on the shard) is all-gathered and unpadded
  before it leaves the model, i.e. before the logits.
Below the threshold, or for any model/layer it does not know, it behaves exactly as vLLM does.
Why: an all-reduce costs a reduce-scatter plus an all-gather anyway; splitting it lets the norm and
residual work in between run on 1/TP of the tokens (vllm-ascend's FLASHCOMM1 idea).

Collectives: vLLM's own TP group (`get_tp_group().reduce_scatter / all_gather`), so the same code
runs over gloo/shared memory on CPU and HCCL on NPU; no NPU-only op is needed.

Compile: the threshold is a per-step Python decision made in the model's `__call__`, OUTSIDE the
graph vLLM compiles. A flashcomm step sets vLLM's `ForwardContext.skip_compiled` and runs the
model's forward eagerly; every other step runs vLLM's compiled graph, which is traced with
flashcomm inactive and so is vLLM's own graph. `compile_ranges_endpoints` was investigated and not
used: vLLM compiles one graph per token range, but all ranges come from ONE dynamo trace of the
forward, so they cannot hold two different Python paths (sharded vs not). Consequence (documented
in docs/modules.md): in graph mode, steps at or above the threshold run eager. The compile cache
key gets this patch's settings mixed in (`_compile_key`).

Limits (falls back to vLLM's path, exactly): pipeline parallelism, inputs_embeds, auxiliary hidden
states (EAGLE), decoder layers other than Qwen2DecoderLayer/LlamaDecoderLayer, and calls made
while something else is being compiled.

Mechanism: class attribute swaps (`Swaps`) of Qwen2Model/LlamaModel.__call__ and
.embed_input_ids, ColumnParallelLinear.forward and RowParallelLinear.forward. The layer wrappers
check one module-level step state and do nothing unless a flashcomm step is running.
Targets: vllm>=0.23,<0.28 (forward(self, input_) on both linear classes; model forward(input_ids,
positions, intermediate_tensors, inputs_embeds); ForwardContext.skip_compiled).
Upstream: vllm-ascend FLASHCOMM1 (VLLM_ASCEND_ENABLE_FLASHCOMM1); vLLM's sequence-parallelism pass.
Undo: revert() restores every swapped attribute.
Remove when vllm-ascend ships token-sharded row-parallel layers again (dropped by its PR #13946).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout_ext.modules import ACTIVE
from rollout_ext.patches._ascend import require_vllm_linear_forward
from rollout_ext.patches._base import PatchError, Swaps, require_signature, require_vllm
from rollout_ext.patches._compile_key import add_compile_key
from rollout_ext.patches._context import get_context, reset_context, step_context
from rollout_ext.patches._counters import Counters

NAME = "flashcomm"
logger = logging.getLogger("vllm.rollout_ext")
_swaps = Swaps(NAME)
COUNTERS = Counters("steps", "reduce_scatters", "all_gathers")


def padded_rows(num_tokens: int, tp_size: int) -> int:
    """The smallest multiple of tp_size that holds num_tokens rows."""
    return -(-num_tokens // tp_size) * tp_size


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (zeros stay zero through RMSNorm and the sums)."""
    extra = rows - x.shape[0]
    return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra))


@dataclass
class Step:
    """One flashcomm forward: token counts and the TP group that shards them."""

    group: object
    num_tokens: int

    @property
    def tp_size(self) -> int:
        return self.group.world_size

    @property
    def rows(self) -> int:
        return padded_rows(self.num_tokens, self.tp_size)

    @property
    def shard_rows(self) -> int:
        return self.rows // self.tp_size

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a replicated [T, ...] tensor (padded)."""
        start = self.group.rank_in_group * self.shard_rows
        return pad_rows(full, self.rows)[start : start + self.shard_rows]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial [T, ...] result, keeping only this rank's rows."""
        COUNTERS.add("reduce_scatters")
        return self.group.reduce_scatter(pad_rows(partial, self.rows), dim=0)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, concatenated and unpadded back to [T, ...]."""
        COUNTERS.add("all_gathers")
        return self.group.all_gather(shard, dim=0)[: self.num_tokens]


def active_step() -> Step | None:
    """The running flashcomm step, if any (the step context's `flashcomm_step`)."""
    return get_context().flashcomm_step


def _log_step(step: Step) -> None:
    COUNTERS.add("steps")
    counts = COUNTERS.read()
    steps, scatters = counts["steps"], counts["reduce_scatters"]
    # Powers of two: proof in the log that it keeps running, without a line per step.
    if steps & (steps - 1) == 0:
        logger.info(
            "rollout_ext flashcomm: %d steps sharded, %d reduce-scatters so far "
            "(last step: %d tokens padded to %d, %d rows per rank)",
            steps, scatters, step.num_tokens, step.rows, step.shard_rows,
        )


def plan_step(model, bound: inspect.BoundArguments, min_tokens: int, layer_types: tuple) -> Step | None:
    """A Step when this model call can run token-sharded; None to run it as vLLM does."""
    from vllm.distributed import get_pp_group, get_tp_group

    args = bound.arguments
    input_ids = args.get("input_ids")
    if input_ids is None or args.get("inputs_embeds") is not None or args.get("intermediate_tensors") is not None:
        return None
    if torch.compiler.is_compiling() or get_pp_group().world_size > 1:
        return None
    if getattr(model, "aux_hidden_state_layers", ()):
        return None
    group = get_tp_group()
    num_tokens = input_ids.shape[0]
    if group.world_size < 2 or num_tokens < min_tokens:
        return None
    if not all(type(layer) in layer_types for layer in model.layers):
        return None
    return Step(group=group, num_tokens=num_tokens)


def _run_eager(original_call, model, args, kwargs):
    """Run the model's forward uncompiled: vLLM's own switch when a forward context exists."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return model.forward(*args, **kwargs)
    context = get_forward_context()
    before = context.skip_compiled
    context.skip_compiled = True
    try:
        return original_call(model, *args, **kwargs)
    finally:
        context.skip_compiled = before


def make_model_call(original_call, forward_signature: inspect.Signature, min_tokens: int, layer_types: tuple):
    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        step = None
        if get_context().flashcomm_step is None:
            step = plan_step(self, forward_signature.bind(self, *args, **kwargs), min_tokens, layer_types)
        if step is None:
            return original_call(self, *args, **kwargs)
        with step_context(flashcomm_step=step):
            sharded = _run_eager(original_call, self, args, kwargs)
        _log_step(step)
        return step.all_gather(sharded)

    return __call__


def make_embed(original):
    @functools.wraps(original)
    def embed_input_ids(self, input_ids):
        full = original(self, input_ids)
        step = get_context().flashcomm_step
        return full if step is None else step.shard(full)

    return embed_input_ids


def make_column_forward(original):
    @functools.wraps(original)
    def forward(self, input_):
        step = get_context().flashcomm_step
        if step is not None:
            input_ = step.all_gather(input_)
        return original(self, input_)

    return forward


def make_row_forward(original):
    @functools.wraps(original)
    def forward(self, input_):
        step = get_context().flashcomm_step
        if step is None or not (self.reduce_results and self.tp_size > 1 and self.input_is_parallel):
            return original(self, input_)
        # The reduction sums the bias, so only rank 0 adds it (as vLLM does).
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = step.reduce_scatter(self.quant_method.apply(self, input_, bias))
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)

    return forward


MODEL_ARGS = ["input_ids", "positions", "intermediate_tensors", "inputs_embeds"]


def check_upstream(models: list[type], column_cls: type, row_cls: type) -> None:
    """Raise PatchError when the classes this patch wraps no longer look as it expects."""
    for model_cls in models:
        require_signature(NAME, model_cls.forward, MODEL_ARGS)
        require_signature(NAME, model_cls.embed_input_ids, ["input_ids"])
        if "__call__" not in model_cls.__dict__:
            raise PatchError(
                f"rollout_ext patch {NAME!r}: {model_cls.__qualname__} has no compile wrapper "
                f"(@support_torch_compile); the upstream code moved"
            )
    require_signature(NAME, column_cls.forward, ["input_"])
    require_signature(NAME, row_cls.forward, ["input_"])
    from vllm.forward_context import ForwardContext

    if "skip_compiled" not in getattr(ForwardContext, "__dataclass_fields__", {}):
        raise PatchError(f"rollout_ext patch {NAME!r}: vLLM's ForwardContext has no skip_compiled")


def apply(cfg) -> str:
    if _swaps.applied:
        return ACTIVE
    require_vllm(NAME)
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2Model

    models = [Qwen2Model, LlamaModel]
    check_upstream(models, ColumnParallelLinear, RowParallelLinear)
    require_vllm_linear_forward(NAME)  # on vllm-ascend, its linears reach it
    layer_types = (Qwen2DecoderLayer, LlamaDecoderLayer)
    min_tokens = cfg.flashcomm_min_tokens
    for model_cls in models:
        call = model_cls.__dict__["__call__"]
        signature = inspect.signature(model_cls.forward)
        _swaps.replace(model_cls, "__call__", make_model_call(call, signature, min_tokens, layer_types))
        _swaps.replace(model_cls, "embed_input_ids", make_embed(model_cls.embed_input_ids))
    _swaps.replace(ColumnParallelLinear, "forward", make_column_forward(ColumnParallelLinear.forward))
    _swaps.replace(RowParallelLinear, "forward", make_row_forward(RowParallelLinear.forward))
    add_compile_key(NAME, _swaps, f"min_tokens={min_tokens}")
    return ACTIVE


def revert() -> None:
    _swaps.revert()
    reset_context("flashcomm_step")
