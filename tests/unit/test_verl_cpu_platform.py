"""rollout_ext's CPU platform for verl, in fresh processes of real verl 0.9.1 (the platform is
resolved once per process, so each case runs in its own interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, os
    import verl
    from verl.utils.device import (get_device_id, get_device_name, get_nccl_backend, get_resource_name,
                                   get_torch_device)
    from verl.plugin.platform import get_platform
    out = {"platform": type(get_platform()).__name__, "device": get_device_name()}
    if out["device"] == "cpu":
        device = get_torch_device()
        device.empty_cache(); device.synchronize()
        out.update(device_id=get_device_id(), backend=get_nccl_backend(), resource=get_resource_name(),
                   ipc=get_platform().is_ipc_supported(), max_memory_allocated=device.max_memory_allocated(),
                   free_total=list(device.mem_get_info()))
    from verl.workers.engine.base import EngineRegistry
    import verl.workers.engine.fsdp.transformer_impl
    try:
        out["engine"] = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
    except ValueError as e:
        out["engine"] = str(e)
    import torch.distributed as dist
    from verl.utils.distributed import initialize_global_process_group_ray
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    try:
        initialize_global_process_group_ray(timeout_second=60)
        out["process_group"] = str(dist.get_backend())
    except Exception as e:
        out["process_group"] = f"{type(e).__name__}: {e}"
    if "REVERT" in os.environ:
        from rollout_ext import patches
        patches.revert_all()
    print("RESULT " + json.dumps(out))
""")


def probe(env: dict[str, str], port: int) -> dict:
    import os

    full = {**{k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}, **env, "PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, env=full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_cpu_platform_trains_on_gloo_and_finds_the_fsdp_engine():
    found = probe({"VERL_PLATFORM": "cpu"}, 29611)
    assert found["platform"] == "PlatformCPU"
    assert (found["device"], found["device_id"], found["backend"], found["resource"]) == ("cpu", "cpu", "gloo", "GPU")
    assert found["ipc"] is False  # weights go through /dev/shm
    assert found["max_memory_allocated"] == 0 and found["free_total"][1] > 0
    assert found["engine"] == "FSDPEngineWithLMHead"
    assert found["process_group"] == "cpu:gloo"


def test_without_the_switch_verl_keeps_its_own_platform():
    # Control: the same probe without VERL_PLATFORM=cpu gets verl's fallback (nvidia), which on a
    # CPU-only machine cannot build the process group or find a CPU engine.
    found = probe({}, 29612)
    assert found["platform"] == "PlatformCUDA" and found["device"] == "cuda"
    assert found["process_group"] != "cpu:gloo"


def test_process_group_patch_is_what_makes_gloo_work(tmp_path):
    # Control for the process-group patch: verl's default backend string on the CPU platform.
    code = PROBE.replace("initialize_global_process_group_ray(timeout_second=60)",
                         "initialize_global_process_group_ray.__wrapped__(timeout_second=60)")
    import os

    env = {**os.environ, "VERL_PLATFORM": "cpu", "PORT": "29613"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    assert "Duplicate device type cpu" in json.loads(line[len("RESULT "):])["process_group"]
