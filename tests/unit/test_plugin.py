"""The plugin entry point, its idempotency, the patch registry, and the engine config check."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from rollout_ext import patches
from rollout_ext.config import ConfigError, ExtConfig


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_is_light():
    proc = run_python(
        "import sys, rollout_ext, rollout_ext.config, rollout_ext.patches, rollout_ext.platform\n"
        "print([m for m in ('vllm', 'verl', 'ray', 'torch_npu', 'torch') if m in sys.modules])"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_entry_points_declared():
    vllm_eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert vllm_eps.get("rollout_ext") == "rollout_ext.plugin:register"
    verl_eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    assert verl_eps.get("rollout_ext") == "rollout_ext.verl"


def test_patches_ship_inside_the_package(tmp_path):
    assert patches.__name__ == "rollout_ext.patches"
    code = "import importlib.util as u; print(u.find_spec('patches'), u.find_spec('rollout_ext.patches').origin)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    top_level, origin = proc.stdout.split()
    assert top_level == "None" and origin.endswith("__init__.py")


def test_registry_order_and_selection():
    assert list(patches.PATCHES)[:2] == ["ascend_import_order", "engine_config_check"]
    assert patches.selected(ExtConfig.from_env({"ROLLOUT_EXT_ROPE_CACHE": "0"})) == [
        "ascend_import_order",
        "engine_config_check",
        "cpu_weight_reload",
        "cpu_spec_sampling",
    ]
    cfg = ExtConfig.from_env({"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_MLP_ONLY_TP": "1"})
    assert patches.selected(cfg) == [
        "ascend_import_order", "engine_config_check", "cpu_weight_reload", "cpu_spec_sampling", "rope_cache",
        "mc2_row_parallel", "mlp_only_tp",
    ]
    with pytest.raises(KeyError, match="unknown rollout_ext patch 'nope'"):
        patches.load("nope")


def test_register_is_idempotent_and_logs_once():
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from rollout_ext import plugin\n"
        "plugin.register(); plugin.register(); plugin.register()\n"
        "print('APPLIED', plugin.applied_patches())\n"
        "plugin.unregister(); print('AFTER', plugin.applied_patches(), plugin.current_config())\n"
    )
    env = {"ROLLOUT_EXT_ROPE_CACHE": "0", "PATH": "/usr/bin:/bin"}
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "rollout_ext 0.1.0:" in line]
    assert len(lines) == 1 and "active=[] " in lines[0] and "device=cpu" in lines[0]
    assert "off=[rope_cache,mc2,flashcomm,mlp_only_tp,fav2,tail_drafting]" in lines[0]
    # ascend_import_order and cpu_weight_reload are inert here (no vllm_ascend; no weight sync).
    assert "APPLIED ['engine_config_check', 'cpu_spec_sampling']" in proc.stdout
    assert "AFTER [] None" in proc.stdout


def test_register_rejects_conflicts_before_anything_is_patched():
    code = "from rollout_ext import plugin\nplugin.register()"
    proc = run_python(code, {"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FLASHCOMM": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "ROLLOUT_EXT_MC2=1 with ROLLOUT_EXT_FLASHCOMM=1" in proc.stderr


ENGINE_CHECK = """
import sys
from vllm.engine.arg_utils import EngineArgs
from rollout_ext import patches
from rollout_ext.config import ConfigError, ExtConfig

check = patches.load("engine_config_check")
original = EngineArgs.create_engine_config
cfg = ExtConfig.from_env({"ROLLOUT_EXT_FAV2": "1"})
check.apply(cfg)
check.apply(cfg)
wrapped = EngineArgs.create_engine_config
assert wrapped is not original and wrapped.__wrapped__ is original
args = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, enable_chunked_prefill=True)
try:
    args.create_engine_config()
except ConfigError as e:
    print("REJECTED", e)
check.revert()
assert EngineArgs.__dict__["create_engine_config"] is original
print("REVERTED")
"""


def test_engine_config_check_wraps_rejects_and_reverts(tiny_qwen2):
    # A fresh process with no plugins loaded, so only this patch is in play.
    proc = subprocess.run([sys.executable, "-c", ENGINE_CHECK, str(tiny_qwen2)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": ""}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REJECTED rollout_ext: 1 feature conflict" in proc.stdout
    assert "ROLLOUT_EXT_FAV2=1 with chunked prefill" in proc.stdout
    assert "REVERTED" in proc.stdout


def test_engine_config_check_version_guard(monkeypatch):
    from packaging.version import Version

    from rollout_ext.patches import _base

    monkeypatch.setattr(_base, "vllm_version", lambda: Version("0.30.0"))
    with pytest.raises(patches.PatchError, match="'engine_config_check' supports vllm>=0.23,<0.28; found vllm 0.30.0"):
        patches.load("engine_config_check").apply(ExtConfig.from_env({}))


def test_signature_guard_names_patch():
    from rollout_ext.patches._base import require_signature

    def moved(self, headless, usage_context=None):
        pass

    with pytest.raises(patches.PatchError, match="'engine_config_check'.*expected \\['usage_context', 'headless'\\]"):
        require_signature("engine_config_check", moved, ["usage_context", "headless"])


def test_strict_off_logs_and_continues(monkeypatch):
    from packaging.version import Version

    from rollout_ext import plugin
    from rollout_ext.patches import _base

    monkeypatch.setattr(_base, "vllm_version", lambda: Version("0.99.0"))
    cfg = ExtConfig.from_env({"ROLLOUT_EXT_STRICT": "0", "ROLLOUT_EXT_ROPE_CACHE": "0"})
    applied, states = plugin.apply_patches(cfg)
    assert applied == []  # every version-checked patch refused, the rest inert; the start goes on
    assert {s.state for s in states.values()} == {"off"}
    strict = ExtConfig.from_env({"ROLLOUT_EXT_ROPE_CACHE": "0"})
    with pytest.raises(patches.PatchError):
        plugin.apply_patches(strict)
    patches.load("ascend_import_order").revert()


def test_doctor_json_and_exit_codes():
    base = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "rollout_ext", "doctor", "--json"], capture_output=True, text=True, env=base)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {"device", "versions", "modules", "conflicts"} <= set(report)
    assert report["versions"]["vllm"] and report["modules"]["rope_cache"]["enabled"] is True
    bad = subprocess.run([sys.executable, "-m", "rollout_ext", "doctor"], capture_output=True, text=True,
                         env=base | {"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FLASHCOMM": "1"})
    assert bad.returncode != 0 and "ROLLOUT_EXT_MC2" in bad.stderr and "ROLLOUT_EXT_FLASHCOMM" in bad.stderr
    typo = subprocess.run([sys.executable, "-m", "rollout_ext", "doctor"], capture_output=True, text=True,
                          env=base | {"ROLLOUT_EXT_ROPE_CACHE": "maybe"})
    assert typo.returncode != 0 and "ROLLOUT_EXT_ROPE_CACHE='maybe'" in typo.stderr and "0 or 1" in typo.stderr
    tp = subprocess.run([sys.executable, "-m", "rollout_ext", "doctor", "--tp", "1"], capture_output=True,
                        text=True, env=base | {"ROLLOUT_EXT_MC2": "1"})
    assert tp.returncode == 0 and "does nothing with tensor_parallel_size=1" in tp.stdout


STATES = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')
from rollout_ext import plugin
from rollout_ext.config import ExtConfig
try:
    plugin.register()
except Exception as e:
    print('FAILED', type(e).__name__, str(e).replace(chr(10), ' | '))
    sys.exit(0)
print('STATES', json.dumps({n: s.state for n, s in plugin.module_states().items()}))
plugin.note_engine(plugin.current_config().with_engine(tp_size=1, chunked_prefill=True, enforce_eager=True))
print('ENGINE', json.dumps({n: s.state for n, s in plugin.module_states().items()}))
"""


def _states(env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_python(STATES, {"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "", **env})


def test_status_line_lists_what_bound_and_refusals():
    proc = _states({"ROLLOUT_EXT_MC2": "1", "ROLLOUT_EXT_FAV2": "1", "ROLLOUT_EXT_STRICT": "0"})
    assert proc.returncode == 0, proc.stderr
    status = next(ln for ln in proc.stdout.splitlines() if "rollout_ext 0.1.0:" in ln)
    # fav2 cannot bind on a CPU machine: listed as refused, never as active.
    assert "active=[rope_cache,mc2]" in status and "refused=[fav2]" in status, status
    states = json.loads(proc.stdout.split("STATES ", 1)[1].splitlines()[0])
    assert states == {"rope_cache": "active", "mc2": "active", "flashcomm": "off", "mlp_only_tp": "off",
                      "fav2": "refused", "tail_drafting": "off"}
    # Once the engine says TP=1, mc2 has nothing to fuse: inert, and the status line says so.
    engine = json.loads(proc.stdout.split("ENGINE ", 1)[1].splitlines()[0])
    assert engine["mc2"] == "inert" and engine["rope_cache"] == "active"
    assert any("inert=[mc2]" in ln for ln in proc.stdout.splitlines() if "rollout_ext 0.1.0:" in ln)


def test_strict_refusal_fails_registration_naming_module_and_version():
    proc = _states({"ROLLOUT_EXT_FAV2": "1", "ROLLOUT_EXT_STRICT": "1"})
    assert proc.returncode == 0, proc.stderr
    failed = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED"))
    assert "PatchError" in failed and "module 'fav2' cannot bind on vLLM 0.27.1" in failed
    assert "STATES" not in proc.stdout
    # Control: the same strict run without FAV2 registers.
    assert "STATES" in _states({"ROLLOUT_EXT_FAV2": "0", "ROLLOUT_EXT_STRICT": "1"}).stdout
