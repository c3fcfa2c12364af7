"""Runs a scenario script in a subprocess whose `import torch_npu` finds the emulation package."""

import os
import pathlib
import subprocess
import sys

CONTRACT_DIR = pathlib.Path(__file__).resolve().parent
EMU_DIR = CONTRACT_DIR / "emu"
SCENARIO_DIR = CONTRACT_DIR / "scenarios"
REPO_ROOT = CONTRACT_DIR.parents[1]


def run_scenario(script: str, *args: str, timeout_s: float = 90.0) -> str:
    """Run scenarios/<script> with emu/ first on sys.path; fail with its output if it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(EMU_DIR), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(SCENARIO_DIR / script), *args],
        env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {args} failed (rc={proc.returncode}):\n{output}"
    return output
