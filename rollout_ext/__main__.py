"""Command line: `python -m rollout_ext doctor [--json]`, `env --preset NAME`, and `check --model DIR`."""

from __future__ import annotations

import argparse
import json
import sys

from rollout_ext import __version__
from rollout_ext.config import ConfigError, ExtConfig


def module_support(device: str, vllm_ok: bool) -> dict[str, dict]:
    neutral = "device-neutral torch path" if device != "npu" else "NPU kernels"
    table = {
        "rope_cache": (vllm_ok, neutral),
        "mc2": (vllm_ok, "fused torch_npu kernel" if device == "npu" else "reference matmul+all-reduce (gain is NPU-only)"),
        "flashcomm": (vllm_ok, neutral + "; needs TP>1"),
        "mlp_only_tp": (vllm_ok, neutral + "; needs TP>1"),
        "fav2": (vllm_ok and device == "npu", "NPU only (ATB FlashAttention v2)"),
    }
    return {name: {"supported": ok, "path": how} for name, (ok, how) in table.items()}


def doctor(args) -> int:
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
    modules = module_support(device, vllm_ok)
    for name, entry in modules.items():
        entry["enabled"] = getattr(cfg, name)
    report = {
        "rollout_ext": __version__,
        "device": device,
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
        print(f"rollout_ext {__version__}  device={device}")
        for key, value in report["versions"].items():
            print(f"  {key:18} {value or '-'}")
        print(f"  vLLM range {SUPPORTED_VLLM}: {'ok' if vllm_ok else 'NOT SUPPORTED'}")
        print("modules:")
        for name, entry in modules.items():
            state = "on " if entry["enabled"] else "off"
            ok = "supported" if entry["supported"] else "unsupported"
            print(f"  {name:12} {state} {ok:11} {entry['path']}")
        for w in report["warnings"]:
            print(f"warning: {w}")
        for c in report["conflicts"]:
            print(f"CONFLICT: {c}")
    if report["conflicts"]:
        print(f"rollout_ext: {len(report['conflicts'])} conflict(s); see above", file=sys.stderr)
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
    p = sub.add_parser("doctor", help="platform, versions, modules and conflicts; exits 1 on a conflict")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--tp", type=int, help="check against this tensor_parallel_size")
    p.add_argument("--enforce-eager", action="store_true", help="with --tp: the engine runs eager")
    p.add_argument("--no-chunked-prefill", action="store_true", help="with --tp: chunked prefill off")
    p.set_defaults(func=doctor)
    p = sub.add_parser("env", help="print a Ray runtime_env YAML preset")
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override or add a variable")
    p.set_defaults(func=env)
    from rollout_ext.check import add_parser

    add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
