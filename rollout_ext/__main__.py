"""Command line: `python -m rollout_ext doctor [--json]`, `env --preset NAME`, and `check --model DIR`.

`doctor` binds every enabled module the way the plugin would in an engine process (and reverts it),
so the state it reports for each module (active, upstream, inert, refused, off) is what bound here."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from rollout_ext import __version__
from rollout_ext.config import ConfigError, ExtConfig


@contextlib.contextmanager
def _stdout_to_stderr():
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def module_report(cfg: ExtConfig) -> dict[str, dict]:
    """Each module's state in a process like this one: its patch is really applied (and then
    reverted), so a module reported active has bound to the classes this process would build."""
    import msgspec

    from rollout_ext import modules, patches, plugin

    trial = msgspec.structs.replace(cfg, strict=False)
    applied, states = plugin.apply_patches(trial)
    while applied:
        patches.load(applied.pop()).revert()
    report = {}
    for module in modules.MODULES:
        state = states[module.name]
        if state.state == modules.ACTIVE and module.needs_tp and cfg.tp_size == 1:
            state = msgspec.structs.replace(state, state=modules.INERT, detail="tensor_parallel_size=1")
        binding = module.stacks[state.stack]
        report[module.name] = {
            "state": state.state, "enabled": getattr(cfg, module.name), "stack": state.stack,
            "patch": binding.patch, "hooks": list(binding.hooks), "detail": state.detail,
            "npu_only": module.npu_only,
        }
    return report


def doctor(args) -> int:
    import logging

    from rollout_ext import platform
    from rollout_ext.patches._base import SUPPORTED_VLLM
    from packaging.specifiers import SpecifierSet

    try:
        cfg = ExtConfig.from_env()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.tp is not None:
        cfg = cfg.with_engine(tp_size=args.tp, chunked_prefill=not args.no_chunked_prefill, enforce_eager=args.enforce_eager)
    device = platform.device_type()
    version = platform.vllm_version()
    vllm_ok = version is not None and version in SpecifierSet(SUPPORTED_VLLM)
    # The trial bind logs each refusal; the report carries them.
    logging.getLogger("vllm.rollout_ext").setLevel(logging.CRITICAL)
    with _stdout_to_stderr():
        # vLLM logs to stdout when it is imported; doctor's stdout is the report alone.
        modules = module_report(cfg)
    refused = [name for name, entry in modules.items() if entry["state"] == "refused"]
    report = {
        "rollout_ext": __version__,
        "device": device,
        "stack": platform.stack(),
        "vllm_ascend": platform.vllm_ascend_version(),
        "versions": platform.versions(cfg.ascend_toolkit_home),
        "vllm_supported_range": SUPPORTED_VLLM,
        "vllm_in_range": vllm_ok,
        "modules": modules,
        "config": {k: getattr(cfg, k) for k in cfg.__struct_fields__},
        "conflicts": cfg.conflicts(),
        "warnings": cfg.warnings(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"rollout_ext {__version__}  device={device}  stack={report['stack']}")
        for key, value in report["versions"].items():
            print(f"  {key:18} {value or '-'}")
        print(f"  vLLM range {SUPPORTED_VLLM}: {'ok' if vllm_ok else 'NOT SUPPORTED'}")
        print("modules:")
        for name, entry in modules.items():
            print(f"  {name:12} {entry['state']:8} {entry['patch'] or '-'}")
            if entry["detail"]:
                print(f"  {'':12} {entry['detail']}")
        for w in report["warnings"]:
            print(f"warning: {w}")
        for c in report["conflicts"]:
            print(f"CONFLICT: {c}")
    if report["conflicts"]:
        print(f"rollout_ext: {len(report['conflicts'])} conflict(s); see above", file=sys.stderr)
        return 1
    if refused and cfg.strict:
        print(f"rollout_ext: refused with ROLLOUT_EXT_STRICT=1, the engine would not start: {', '.join(refused)}",
              file=sys.stderr)
        return 1
    return 0


def env(args) -> int:
    from rollout_ext import platform, runtime_env

    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key] = value
    try:
        values = runtime_env.preset_env(args.preset, platform.vllm_version(), overrides)
    except (ValueError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 2
    print(runtime_env.to_yaml(args.preset, values), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rollout_ext.runtime_env import PRESETS

    parser = argparse.ArgumentParser(prog="python -m rollout_ext", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rollout_ext {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="platform, versions, module states and conflicts; exits 1 on a conflict or a strict refusal")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--tp", type=int, help="check against this tensor_parallel_size")
    p.add_argument("--enforce-eager", action="store_true", help="with --tp: the engine runs eager")
    p.add_argument("--no-chunked-prefill", action="store_true", help="with --tp: chunked prefill off")
    p.set_defaults(func=doctor)
    p = sub.add_parser("env", help="print a Ray runtime_env YAML preset")
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override or add a variable")
    p.set_defaults(func=env)
    from rollout_ext import check, spec_estimate

    check.add_parser(sub)
    spec_estimate.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
