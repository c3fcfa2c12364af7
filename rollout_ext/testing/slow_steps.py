"""A vLLM logits processor that makes chosen replicas step slower (test-only): a degraded device on demand.

Real replicas are not all alike, and the tail_aware policy learns each one's speed from the clock
(rollout_ext/balance/speeds.py). To check that on real engines, a benchmark or test needs replicas
that really are unequal, and a control where they are not, on the same engines. So the slowdown is
switched from outside while the engines run:

- Engine args: `logits_processors=[FQCN]` and `additional_config={"slow_steps_dir": DIR}`.
- At start, each engine writes `DIR/engine-<pid>` with its process's ancestors (`engines(DIR)` lists
  the pids; `engine_under(DIR, pid)` finds the engine that process `pid`, a replica's server, started).
- `set_slow(DIR, {pid: ms})` makes engine `pid` sleep `ms` milliseconds in every decode step, on top
  of its own work; `set_slow(DIR, {})` ends it. An engine re-reads its file at most every
  READ_EVERY_S, so a switch takes effect within that.

The sleep is a fixed cost per step (a larger `base_ms` in the step model's terms), in the engine's
own process, so everything the router sees (chunk times, boundaries) sees it. Without
`slow_steps_dir` the processor does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

FQCN = "rollout_ext.testing.slow_steps:SlowStepsLogitsProcessor"
CONFIG_KEY = "slow_steps_dir"
READ_EVERY_S = 0.2


def _pid(path: Path) -> int:
    return int(path.name.split("-", 1)[1])  # engine-<pid>, slow-<pid>


def engines(directory: str | Path) -> list[int]:
    """The pids of the engines that registered in `directory`, in ascending order."""
    return sorted(map(_pid, Path(directory).glob("engine-*")))


def engine_under(directory: str | Path, pid: int) -> int:
    """The engine whose process descends from process `pid` (a replica's server starts its engine)."""
    found = [_pid(p) for p in Path(directory).glob("engine-*") if pid in json.loads(p.read_text())["ancestors"]]
    if len(found) != 1:
        raise LookupError(f"slow steps: {len(found)} engine(s) in {directory} descend from process {pid}; expected 1")
    return found[0]


def set_slow(directory: str | Path, ms_by_pid: dict[int, float]) -> None:
    """Engine `pid` sleeps `ms` per step; every engine not named runs at its own speed."""
    for pid, ms in ms_by_pid.items():
        if not ms >= 0:  # checked first: a refused call changes nothing
            raise ValueError(f"set_slow: ms for engine {pid} is {ms!r}; allowed: a number >= 0")
    for path in Path(directory).glob("slow-*"):
        if _pid(path) not in ms_by_pid:
            path.unlink()
    for pid, ms in ms_by_pid.items():
        tmp = Path(directory) / f".slow-{pid}.tmp"
        tmp.write_text(repr(float(ms)))
        tmp.replace(Path(directory) / f"slow-{pid}")  # atomic: an engine never reads half a number


class SlowStepsLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        directory = extra.get(CONFIG_KEY)
        self._control = None
        self._sleep_s = 0.0
        self._read_at = 0.0
        if directory:
            pid = os.getpid()
            Path(directory).mkdir(parents=True, exist_ok=True)
            ancestors = [proc.pid for proc in psutil.Process(pid).parents()]
            (Path(directory) / f"engine-{pid}").write_text(json.dumps({"pid": pid, "ancestors": ancestors}))
            self._control = Path(directory) / f"slow-{pid}"

    def is_argmax_invariant(self) -> bool:
        return False  # greedy batches skip argmax-invariant processors, and this one must run every step

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._control is None:
            return logits
        now = time.monotonic()
        if now >= self._read_at:
            self._read_at = now + READ_EVERY_S
            try:
                self._sleep_s = float(self._control.read_text()) * 1e-3
            except FileNotFoundError:
                self._sleep_s = 0.0
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
        return logits
