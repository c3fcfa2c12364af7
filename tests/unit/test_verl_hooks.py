"""Post-import hooks: a callback runs once, after the module body, before the importer binds names."""

from __future__ import annotations

import sys

from rollout_ext.verl.hooks import pending_modules, when_imported


def test_callback_patches_before_from_import_binds(tmp_path, monkeypatch):
    (tmp_path / "hook_target_mod.py").write_text("def answer():\n    return 1\n")
    (tmp_path / "hook_user_mod.py").write_text("from hook_target_mod import answer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def patch(module):
        calls.append(module.__name__)
        module.answer = lambda: 2

    when_imported("hook_target_mod", patch)
    assert "hook_target_mod" in pending_modules()
    try:
        import hook_user_mod

        assert hook_user_mod.answer() == 2
        assert calls == ["hook_target_mod"]
        assert "hook_target_mod" not in pending_modules()
        # already imported: runs at once, and the loader left on the module is the real one
        when_imported("hook_target_mod", patch)
        assert calls == ["hook_target_mod", "hook_target_mod"]
        assert type(sys.modules["hook_target_mod"].__loader__).__name__ == "SourceFileLoader"
    finally:
        sys.modules.pop("hook_target_mod", None)
        sys.modules.pop("hook_user_mod", None)
