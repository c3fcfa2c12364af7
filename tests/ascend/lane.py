"""The Ascend-on-CPU lane: vllm-ascend's real Python source imported beside vLLM on CPU.

`enter(upstream)` must run first in a fresh process (the emulation renames torch's PrivateUse1
backend, which cannot be undone). It puts on sys.path, ahead of everything:
- tests/contract/emu: the torch_npu emulation (each op bound to the real 2.14 schema, documented
  math, NotImplementedError naming any op nobody emulated);
- the vllm-ascend source tree (test data in ../shared/upstream, never copied into the project).
and provides what a build of vllm-ascend has and a source tree lacks:
- `vllm_ascend._build_info` (the generated build module; A2, as our users run);
- a CPU kernel for each custom op vllm-ascend registers under the PrivateUse1 dispatch key: here
  the "npu" tensors are host tensors, so the op's own Python body must run for the CPU key too.
- vLLM's CustomOp dispatch as on vllm-ascend's out-of-tree platform, for vllm-ascend's own classes:
  their `forward_oot` (its NPUPlatform sets `custom_ops = ["all"]` and is out-of-tree). vLLM's own
  classes keep the CPU dispatch, so the lane runs on the real CPU platform otherwise.
Nothing else of vllm-ascend is changed. Custom ops are registered by `register_ops`, the same call
its NPUWorker makes (`vllm_ascend.utils.register_ascend_customop(vllm_config)`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
EMU_DIR = REPO_ROOT / "tests" / "contract" / "emu"
UPSTREAM_NAME = "vllm-ascend-main-182b75e"
DEFAULT_UPSTREAM = REPO_ROOT.parent / "shared" / "upstream" / UPSTREAM_NAME
# What _build_info says on an Atlas A2 (910B) build of vllm-ascend.
BUILD_INFO = {"__device_type__": "A2", "__soc_version__": "ASCEND910B1", "__sleep_mode_enabled__": False}


def _host_kernels_for_npu_ops() -> None:
    from vllm.utils import torch_utils

    original = torch_utils.direct_register_custom_op
    if getattr(original, "_ascend_lane", False):
        return

    def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None,
                                  target_lib=None, dispatch_key=None, tags=()):
        original(op_name, op_func, mutates_args, fake_impl, target_lib, dispatch_key, tags)
        if dispatch_key == "PrivateUse1":
            (target_lib or torch_utils.vllm_lib).impl(op_name, op_func, dispatch_key="CPU")

    direct_register_custom_op._ascend_lane = True
    torch_utils.direct_register_custom_op = direct_register_custom_op


def _out_of_tree_dispatch_for_ascend_ops() -> None:
    from vllm.model_executor.custom_op import CustomOp

    original = CustomOp.dispatch_forward
    if getattr(original, "_ascend_lane", False):
        return

    def dispatch_forward(self, compile_native: bool):
        if type(self).__module__.startswith("vllm_ascend."):
            return self.forward_oot
        return original(self, compile_native)

    dispatch_forward._ascend_lane = True
    CustomOp.dispatch_forward = dispatch_forward


def enter(upstream: Path | str = DEFAULT_UPSTREAM):
    """Make `import vllm_ascend` load the source tree at `upstream`; returns the package."""
    upstream = Path(upstream)
    if not (upstream / "vllm_ascend" / "__init__.py").is_file():
        raise FileNotFoundError(f"no vllm_ascend package under {upstream}")
    for path in (str(REPO_ROOT), str(upstream), str(EMU_DIR)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    import torch_npu  # noqa: F401  (the emulation: names the "npu" device, registers "hccl")

    build_info = types.ModuleType("vllm_ascend._build_info")
    build_info.__dict__.update(BUILD_INFO)
    sys.modules.setdefault("vllm_ascend._build_info", build_info)
    _host_kernels_for_npu_ops()
    _out_of_tree_dispatch_for_ascend_ops()
    import vllm_ascend

    if Path(vllm_ascend.__file__).resolve().parent != (upstream / "vllm_ascend").resolve():
        raise RuntimeError(f"vllm_ascend came from {vllm_ascend.__file__}, not {upstream}")
    return vllm_ascend


def register_ops(vllm_config) -> None:
    """What vllm-ascend's NPUWorker.__init__ does before it builds a model: register the Ascend
    custom ops (CustomOp.register_oot), then initialise the Ascend config."""
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import register_ascend_customop

    register_ascend_customop(vllm_config)
    init_ascend_config(vllm_config)


def run_scenario(script: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 240) -> str:
    """Run scenarios/<script> in a fresh process (the emulation cannot be undone in the test's own
    process); returns stdout and stderr together, failing with them when the script fails."""
    from rollout_ext.config import environ_copy
    from rollout_ext.testing.dist import free_port

    full_env = {k: v for k, v in environ_copy().items() if not k.startswith("ROLLOUT_EXT_")}
    full_env.update({"VLLM_PLUGINS": "", "VLLM_DIST_IDENT": f"ascend-lane-{free_port()}", **(env or {})})
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS / script), *args], env=full_env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout_s, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, f"{script} {args} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}"
    return proc.stdout
