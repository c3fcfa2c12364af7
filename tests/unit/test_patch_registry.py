"""One patch system: vLLM-side and verl-side patches share the record, the header and revert_all()."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rollout_ext import patches

HEADER_FIELDS = ("Why:", "Targets:", "Undo:")


@pytest.mark.parametrize("name", list(patches.PATCHES))
def test_every_patch_has_a_header_apply_and_revert(name):
    module = patches.load(name)
    doc = module.__doc__ or ""
    assert all(field in doc for field in HEADER_FIELDS), (name, doc[:300])
    assert "Remove when" in doc or "remove when" in doc.lower(), name
    assert callable(module.apply) and callable(module.revert)
    record = patches.PATCHES[name]
    assert record.side in ("vllm", "verl")
    assert (record.target is not None) == (record.side == "verl"), name


def test_revert_all_undoes_both_sides_in_a_real_process():
    # A fresh interpreter: verl's entry point schedules the verl-side patches, the vLLM plugin
    # applies its own; one revert_all() must leave every wrapped function as upstream wrote it.
    code = textwrap.dedent("""
        import json
        import verl
        from rollout_ext import plugin, patches
        import verl.workers.rollout.llm_server as llm_server
        import verl.utils.config as vconfig
        import verl.utils.debug as vdebug
        import verl.utils.profiler as vprofiler
        import verl.experimental.separation.ray_trainer as separation
        import verl.experimental.fully_async_policy.fully_async_rollouter as rollouter
        from vllm.engine.arg_utils import EngineArgs
        plugin.register()
        sites = {
            "get_client": lambda: hasattr(llm_server.LLMServerManager.get_client, "__wrapped__"),
            "client_init": lambda: hasattr(llm_server.LLMServerClient.__init__, "__wrapped__"),
            "validate_config": lambda: hasattr(vconfig.validate_config, "__wrapped__"),
            # verl's own marked_timer is a contextmanager (it has __wrapped__): compare with its source.
            "marked_timer": lambda: vdebug.marked_timer is not vprofiler.marked_timer,
            "create_engine_config": lambda: hasattr(EngineArgs.create_engine_config, "__wrapped__"),
            "separate_step": lambda: hasattr(separation.SeparateRayPPOTrainer._fit_collect_metrics, "__wrapped__"),
            "fully_async_step": lambda: "verl_epoch_end_fully_async" in
                rollouter.FullyAsyncRollouter.__ray_metadata__.modified_class.reset_staleness.__code__.co_filename,
        }
        before = {k: patched() for k, patched in sites.items()}
        patches.revert_all()
        after = {k: patched() for k, patched in sites.items()}
        import verl.trainer.ppo.v1.trainer_base as tb  # imported after revert_all: stays unpatched
        after["trainer_step"] = hasattr(tb.PPOTrainer.step, "__wrapped__")
        print("RESULT " + json.dumps({"before": before, "after": after, "applied": plugin.applied_patches()}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert all(result["before"].values()), result["before"]  # control: each site was wrapped
    assert not any(result["after"].values()), result
    assert result["applied"] == []
