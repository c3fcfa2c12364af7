"""What each module's patch really swaps, on stock vLLM or vllm-ascend main, against the hooks its
module record lists.

Run: python tests/unit/hook_audit.py [--ascend] [--unlisted-swap] ; prints one JSON object:
{module: {"patch": name, "swapped": [...], "listed": [...], "unlisted": [...]}}.

For each module of the table with a patch on the stack: apply and revert once (so every module
the patch touches is imported), take a snapshot of every module-level name and class attribute
under vllm.* and vllm_ascend.*, apply, diff, revert. The stack is "vllm", or with --ascend
"ascend-main" (vllm-ascend main's source under the Ascend lane's emulation). A swapped attribute is
named by the class (or module) that owns it; a listed hook (the record's, plus
modules.COMMON_HOOKS) is resolved the same way, so a hook named through a re-export
(vllm.config.ModelConfig) matches vllm.config.model.ModelConfig.
--unlisted-swap is the control: during rope_cache's apply, one more attribute is swapped.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def snapshot() -> dict[str, object]:
    """Every module-level name and class attribute of the loaded vllm modules, by canonical name.
    Values are kept (not ids), so a replaced object can never share an id with its replacement."""
    seen: dict[str, object] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".", 1)[0] not in ("vllm", "vllm_ascend"):
            continue
        for attr, value in list(vars(module).items()):
            seen[f"{module_name}.{attr}"] = value
            if isinstance(value, type) and value.__module__ == module_name:
                for class_attr, class_value in list(vars(value).items()):
                    seen[f"{module_name}.{value.__qualname__}.{class_attr}"] = class_value
    return seen


def swapped(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Attributes replaced, and attributes added to a module or class that existed before (a method
    set on a subclass that inherited it)."""
    owners = {name.rsplit(".", 1)[0] for name in before}
    return sorted(name for name, value in after.items()
                  if not name.endswith(".__dict__")
                  and (before[name] is not value if name in before else name.rsplit(".", 1)[0] in owners))


def resolve(hook: str) -> str | None:
    """A hook text ("pkg.mod.Class.attr (note)") as the canonical name of what it names, or None
    when it names no attribute (a registry entry, an engine argument)."""
    path = hook.split(" (", 1)[0].split(".")
    for split in range(len(path) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(path[:split]))
        except ImportError:
            continue
        for name in path[split:-1]:
            owner = getattr(owner, name, None)
        if owner is None:
            return None
        attr = path[-1]
        if isinstance(owner, type):  # named by the class the hook names, as the snapshot names it
            return f"{owner.__module__}.{owner.__qualname__}.{attr}"
        return f"{owner.__name__}.{attr}" if hasattr(owner, attr) else None
    return None


def run(*args: str) -> dict:
    """This audit in a fresh process (patches applied here cannot be undone for the caller)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_EXT_")}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2], env={**env, "VLLM_PLUGINS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("HOOKS "))
    return json.loads(line.removeprefix("HOOKS "))


def main(argv: list[str]) -> int:
    stack = "vllm"
    if "--ascend" in argv:  # vllm-ascend main's source under the lane's emulation
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ascend"))
        import lane

        lane.enter()
        stack = "ascend-main"
    from rollout_ext import modules, patches
    from rollout_ext.config import ExtConfig

    report = {}
    for module in modules.MODULES:
        binding = module.stacks[stack]
        if binding.patch is None:
            continue
        patch = patches.load(binding.patch)
        cfg = ExtConfig(**{m.name: m.name == module.name for m in modules.MODULES})
        try:
            patch.apply(cfg)
        except patches.PatchError as e:  # refuses here (fav2 without an NPU): nothing may change
            before = snapshot()
            try:
                patch.apply(cfg)
            except patches.PatchError:
                pass
            report[module.name] = {"patch": binding.patch, "refused": str(e),
                                   "swapped": swapped(before, snapshot()), "listed": [], "unlisted": []}
            continue
        patch.revert()
        before = snapshot()
        patch.apply(cfg)
        if "--unlisted-swap" in argv and module.name == "rope_cache":
            from vllm.model_executor.layers import linear

            linear.RowParallelLinear.extra_repr = lambda self: "control"
        after = snapshot()
        patch.revert()
        listed = {resolve(hook) for hook in binding.hooks + modules.COMMON_HOOKS} - {None}
        found = swapped(before, after)
        report[module.name] = {"patch": binding.patch, "swapped": found, "listed": sorted(listed),
                               "unlisted": [name for name in found if name not in listed]}
    print("HOOKS " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
