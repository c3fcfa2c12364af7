"""Two CPU ranks under vLLM's real distributed state (gloo), for tests that need a TP group.

A scenario script spawns its ranks and enters `vllm_tp_group` in each; a test starts the script with
`run_ranks` and reads "rank N: ok" lines from its output.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

from rollout_ext.config import environ_copy


@contextlib.contextmanager
def vllm_tp_group(rank: int, port: int, world_size: int = 2):
    """vLLM's world and tensor-parallel groups over gloo on 127.0.0.1, torn down on exit."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank, backend="gloo",
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, repo_root: Path, name: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run a scenario script (argv[1] = rendezvous port); output is stdout and stderr together."""
    env = {**environ_copy(), "VLLM_DIST_IDENT": f"{name}-{free_port()}", "PYTHONPATH": str(repo_root)}
    return subprocess.run(
        [sys.executable, str(script), str(free_port())], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s,
    )
