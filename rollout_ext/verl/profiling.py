"""Phase-separated profiling: the rollout and the actor update, each traced on its own.

verl already reaches most of the way, and we go through it:
- the rollout phase is traced inside each vLLM engine by verl's rollout profiler
  (actor_rollout_ref.rollout.profiler, discrete mode), which vLLMHttpServer turns into vLLM's
  profiler config and starts/stops around generation; rollout_ext servers inherit all of it;
- the actor update is traced by verl's actor profiler (actor_rollout_ref.actor.profiler).
The gap: verl's agent-loop servers accept only the torch and npu tools (vllm_async_server.py:182-190
drops any other tool with a warning), and the rollout profiler inherits enable/ranks from the actor's,
so "rollout only" needs both set explicitly. `phase_overrides()` builds that, picking the npu tool
when torch_npu is present and torch otherwise. `phase_trace()` covers code verl does not profile
(e.g. a driver-side rollout loop), with torch_npu.profiler on NPU (imported lazily) and
torch.profiler elsewhere. Both write traces Perfetto and TensorBoard open.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rollout_ext.platform import has_torch_npu

PHASES = ("rollout", "actor")


def profiler_tool() -> str:
    return "npu" if has_torch_npu() else "torch"


def phase_overrides(phase: str, save_dir: str | Path, *, steps: Sequence[int] = (1,),
                    ranks: Sequence[int] = (0,), contents: Sequence[str] = ()) -> list[str]:
    """Hydra overrides that profile one phase only, on `ranks` (rank 0 by default), at `steps`."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    tool = profiler_tool()
    other = "actor" if phase == "rollout" else "rollout"
    role = f"actor_rollout_ref.{phase}.profiler"
    listed = lambda values: "[" + ",".join(str(v) for v in values) + "]"  # noqa: E731
    return [
        f"global_profiler.tool={tool}",
        f"global_profiler.steps={listed(steps)}",
        f"global_profiler.save_path={save_dir}",
        f"{role}.enable=True",
        f"{role}.all_ranks=False",
        f"{role}.ranks={listed(ranks)}",
        # discrete: one trace per phase call, which is what separates the phases
        f"{role}.tool_config.{tool}.discrete=True",
        f"{role}.tool_config.{tool}.contents={listed(contents)}",
        f"actor_rollout_ref.{other}.profiler.enable=False",
    ]


def rollout_only_preset(save_dir: str | Path, *, max_response_length: int = 256) -> list[str]:
    """Profile one rollout with small traces: short responses, no DAPO refills, no validation."""
    return [
        *phase_overrides("rollout", save_dir),
        f"data.max_response_length={max_response_length}",
        f"actor_rollout_ref.rollout.response_length={max_response_length}",
        "algorithm.filter_groups.enable=False",
        "++reward.reward_kwargs.overlong_buffer_cfg.enable=False",
        "trainer.val_before_train=False",
        "trainer.total_training_steps=1",
    ]


@contextmanager
def phase_trace(phase: str, save_dir: str | Path, *, rank: int = 0, ranks: Sequence[int] = (0,)) -> Iterator[None]:
    """Trace the enclosed code as `phase` when `rank` is one of `ranks`; a no-op elsewhere."""
    if rank not in ranks:
        yield
        return
    out = Path(save_dir) / phase
    out.mkdir(parents=True, exist_ok=True)
    worker = f"{phase}_rank{rank}"
    if has_torch_npu():
        import torch_npu

        prof = torch_npu.profiler.profile(
            activities=[torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU],
            on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(str(out), worker_name=worker),
        )
    else:
        import torch

        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out), worker_name=worker),
        )
    with prof:
        yield


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m rollout_ext.verl.profiling SAVE_DIR`: print the rollout-only preset as CLI overrides.

    Printed unquoted, for `$(...)` in a shell command line (no value contains spaces).
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("save_dir")
    parser.add_argument("--max-response-length", type=int, default=256)
    args = parser.parse_args(argv)
    overrides = rollout_only_preset(args.save_dir, max_response_length=args.max_response_length)
    print(" ".join(overrides))


if __name__ == "__main__":
    main()
