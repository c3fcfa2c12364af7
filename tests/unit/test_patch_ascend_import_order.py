"""ascend_import_order: vllm-ascend's platform then worker patches load before any other rollout_ext patch.

A real package layout stands in for vllm-ascend: a temporary directory holding `vllm_ascend` with
`patch/platform/__init__.py` and `patch/worker/__init__.py`. Each records, when imported, which
rollout_ext patch modules were already imported. The plugin's own `register()` runs in a subprocess
with that directory on sys.path, exactly as vLLM would call it in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollout_ext.config import PREFIX

REPO_ROOT = Path(__file__).resolve().parents[2]

RECORDER = '''
import sys
import vllm_ascend

vllm_ascend.IMPORTED.append({{
    "module": __name__,
    "patch_modules": sorted(m for m in sys.modules if m.startswith("rollout_ext.patches.")),
}})
'''

DRIVER = '''
import json, sys
from rollout_ext import plugin
from rollout_ext.patches import ascend_import_order

plugin.register()
plugin.register()  # vLLM may call it twice in one process
ascend = sys.modules.get("vllm_ascend")
print(json.dumps({
    "recorded": getattr(ascend, "IMPORTED", None),
    "imported": ascend_import_order.imported(),
    "applied": plugin.applied_patches(),
    "states": {name: s.state for name, s in plugin.module_states().items()},
    "patch_modules": sorted(m for m in sys.modules if m.startswith("rollout_ext.patches.")),
}))
'''

# Modules that exist before any patch is applied: the registry itself and its shared helpers.
REGISTRY_MODULES = {"rollout_ext.patches._base", "rollout_ext.patches.ascend_import_order"}


def make_vllm_ascend(root: Path, parts=("platform", "worker"), broken: str | None = None) -> Path:
    package = root / "vllm_ascend"
    (package / "patch").mkdir(parents=True)
    (package / "__init__.py").write_text("IMPORTED = []\n")
    (package / "patch" / "__init__.py").write_text("")
    for part in parts:
        (package / "patch" / part).mkdir()
        source = RECORDER.format()
        if part == broken:
            source += "\nfrom vllm_ascend.no_such_module import anything\n"
        (package / "patch" / part / "__init__.py").write_text(source)
    return root


def run_register(extra_path: Path | None, strict: bool = True, check: bool = True) -> dict | subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    # Engine check is always on; mc2 stands for a model patch applied after it. With the stand-in
    # vllm_ascend on sys.path the stack is vllm-ascend's, where mc2 binds vllm_ascend.ops.linear,
    # which the stand-in lacks: refused (strict=False) after the import order was kept.
    env.update({f"{PREFIX}ROPE_CACHE": "0", f"{PREFIX}MC2": "1", f"{PREFIX}STRICT": str(int(strict))})
    paths = [str(extra_path)] if extra_path else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(REPO_ROOT)])
    proc = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, timeout=180)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ascend_patches_import_first_platform_then_worker(tmp_path):
    result = run_register(make_vllm_ascend(tmp_path), strict=False)
    assert [r["module"] for r in result["recorded"]] == ["vllm_ascend.patch.platform", "vllm_ascend.patch.worker"]
    for record in result["recorded"]:
        # No model patch module was even imported, so none had been applied yet.
        assert set(record["patch_modules"]) <= REGISTRY_MODULES, record
    assert result["imported"] == ["vllm_ascend.patch.platform", "vllm_ascend.patch.worker"]
    # cpu_spec_sampling: the stand-in runs on the CPU platform.
    assert result["applied"] == ["ascend_import_order", "engine_config_check", "cpu_spec_sampling"]
    assert result["states"]["mc2"] == "refused"
    assert {"rollout_ext.patches.engine_config_check", "rollout_ext.patches.mc2_ascend"} <= set(
        result["patch_modules"]
    )


def test_missing_worker_patches_are_skipped(tmp_path):
    result = run_register(make_vllm_ascend(tmp_path, parts=("platform",)), strict=False)
    assert [r["module"] for r in result["recorded"]] == ["vllm_ascend.patch.platform"]
    assert result["imported"] == ["vllm_ascend.patch.platform"]
    assert result["applied"][0] == "ascend_import_order"


def test_no_op_without_vllm_ascend():
    result = run_register(None)
    assert result["recorded"] is None
    assert result["imported"] == []
    # Inert: nothing imported, so nothing is listed as applied.
    assert result["applied"] == ["engine_config_check", "cpu_spec_sampling", "mc2_row_parallel"]
    assert result["states"]["mc2"] == "active"


def test_broken_ascend_patch_fails_strict_and_is_skipped_otherwise(tmp_path):
    root = make_vllm_ascend(tmp_path, broken="worker")
    proc = run_register(root, check=False)
    assert proc.returncode != 0
    # Strict mode collects every failure into one PatchError: this one, and mc2, which cannot bind
    # on the stand-in (it has no vllm_ascend.ops).
    assert "PatchError: rollout_ext: 2 patches cannot apply (ROLLOUT_EXT_STRICT=1)" in proc.stderr
    assert "rollout_ext patch 'ascend_import_order': importing vllm_ascend.patch.worker failed" in proc.stderr
    result = run_register(root, strict=False)
    assert "ascend_import_order" not in result["applied"]
    assert result["applied"] == ["engine_config_check", "cpu_spec_sampling"]
