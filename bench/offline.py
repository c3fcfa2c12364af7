"""Offline vLLM benchmark: A/B of rollout_ext modules in one invocation.

Each variant is a set of environment switches and runs in a fresh engine (its own subprocess), so
patches from one variant never leak into the next. Every variant gets the same prompts, greedy. Two
workloads:
- `--workload random` (the default): random token-id prompts and per-request output lengths
  (ignore_eos) on the random-weight tiny model, so every variant generates the same number of tokens;
- `--workload arith`: arithmetic problems on the trained tiny model (rollout_ext.testing.arith),
  which stops when it has answered, so lengths follow the prompt. Two responses are printed.

    python bench/offline.py --variants off,rope_cache,all --json out/offline.json --plot out/offline.png

Prints the setup, a table of tokens/s, TTFT and the tokens/s ratio against `off`; writes JSON and
a bar chart. Each engine times --repeats batches on fresh prompts and reports the fastest, since
other load only slows a run down. Compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from rollout_ext import modules as module_table  # noqa: E402
from rollout_ext.testing import arith  # noqa: E402
from rollout_ext.testing.tiny_model import build_tiny_model, default_model_dir  # noqa: E402

# Single modules and the switch each one turns on.
MODULE_SWITCHES = {m.name: m.switch for m in module_table.MODULES}
# Named sets of modules. flashcomm is left out of `all`: it conflicts with mc2 and mlp_only_tp.
PRESETS = {"off": (), "all": ("rope_cache", "mc2", "mlp_only_tp")}
NPU_ONLY_MODULES = {m.name for m in module_table.MODULES if m.npu_only}
THRESHOLD_SWITCHES = tuple(s.variable for s in module_table.settings() if s.min_tokens)
DTYPES = ("float32", "bfloat16", "float16", "auto")
KV_CACHE_BYTES = 256 * 2**20  # the default gpu_memory_utilization sizing fails on CPU
WARMUP_PROMPTS, WARMUP_MAX_TOKENS = 2, 8
WORKLOADS = ("random", "arith")
SAMPLE_RESPONSES = 2
STAGES = ("engine_ready", "warmup_done", "timed_done")
STAGE_MARK = "@@stage "
ERROR_TAIL_LINES = 25


class UsageError(ValueError):
    """A bad command-line value; the message names the flag, the value and what is allowed."""


def known_variants() -> list[str]:
    return ["vanilla", *PRESETS, *MODULE_SWITCHES]


def variant_modules(name: str) -> tuple[str, ...] | None:
    """Modules a variant turns on; None for `vanilla` (no plugin at all)."""
    if name == "vanilla":
        return None
    modules: list[str] = []
    for part in name.split("+"):
        if part in PRESETS:
            modules += PRESETS[part]
        elif part in MODULE_SWITCHES:
            modules.append(part)
        else:
            raise UsageError(f"--variants: unknown variant {part!r} in {name!r}; known: "
                             f"{', '.join(known_variants())} (join modules with '+')")
    return tuple(dict.fromkeys(modules))


def variant_env(name: str, min_tokens: int | None) -> dict[str, str]:
    """The environment that defines a variant; every module switch is explicit."""
    modules = variant_modules(name)
    if modules is None:
        return {"VLLM_PLUGINS": ""}
    env = {"VLLM_PLUGINS": "rollout_ext"}
    env.update({switch: str(int(m in modules)) for m, switch in MODULE_SWITCHES.items()})
    if min_tokens is not None:
        env.update({switch: str(min_tokens) for switch in THRESHOLD_SWITCHES})
    return env


def check_variant_conflicts(name: str, env: dict[str, str]) -> None:
    """Reject impossible combos (e.g. mc2+flashcomm) before any engine starts."""
    from rollout_ext.config import ConfigError, ExtConfig

    if env.get("VLLM_PLUGINS") != "rollout_ext":
        return
    try:
        ExtConfig.from_env(env)
    except ConfigError as err:
        raise UsageError(f"--variants: {name!r} is not a valid combination:\n{err}") from None


def output_lengths(args: argparse.Namespace, rng: random.Random) -> list[int]:
    if args.output_dist == "fixed":
        return [args.output_len] * args.num_prompts
    # Lognormal with the requested mean: E[X] = exp(mu + sigma^2 / 2).
    mu = math.log(args.output_mean) - args.output_sigma**2 / 2
    return [max(1, min(args.output_cap, round(rng.lognormvariate(mu, args.output_sigma))))
            for _ in range(args.num_prompts)]


def make_workload(args: argparse.Namespace, vocab_size: int) -> dict:
    if args.workload == "arith":
        return make_arith_workload(args)
    rng = random.Random(args.seed)
    # Ids 0-2 are the tiny tokenizer's special tokens; other models only need ids < vocab_size.
    def prompt():
        return [rng.randrange(3, vocab_size) for _ in range(args.input_len)]

    # Fresh prompts for warm-up and for every repeat, so prefix caching gives no batch a head start.
    batches = [[prompt() for _ in range(args.num_prompts)] for _ in range(args.repeats)]
    warmup_prompts = [prompt() for _ in range(WARMUP_PROMPTS)]
    return {"batches": batches, "warmup_prompts": warmup_prompts, "max_tokens": output_lengths(args, rng),
            "ignore_eos": True}


def make_arith_workload(args: argparse.Namespace) -> dict:
    """Arithmetic prompts as the trained model's token ids; each request stops at EOS or the cap."""
    from rollout_ext.testing.arith_model import build_tokenizer, char_ids

    ids = char_ids(build_tokenizer())
    rng = random.Random(args.seed)

    def prompt():
        return [ids[c] for c in arith.make_problem(rng).prompt]

    batches = [[prompt() for _ in range(args.num_prompts)] for _ in range(args.repeats)]
    warmup_prompts = [prompt() for _ in range(WARMUP_PROMPTS)]
    return {"batches": batches, "warmup_prompts": warmup_prompts, "ignore_eos": False,
            "max_tokens": [args.output_cap] * args.num_prompts}


def decode_arith(token_ids: list[int]) -> str:
    from rollout_ext.testing.arith_model import build_tokenizer, char_ids

    chars = {token_id: char for char, token_id in char_ids(build_tokenizer()).items()}
    return "".join(chars.get(t, "") for t in token_ids)


# --------------------------------------------------------------------------------------------
# Engine side: runs in the variant's own subprocess.

def run_worker(job_path: Path) -> None:
    job = json.loads(job_path.read_text())
    # Set before vLLM is imported: the plugin and vLLM read them at import / engine start.
    os.environ.update(job["env"])
    for name, value in job["env_defaults"].items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], tensor_parallel_size=job["tp"], dtype=job["dtype"],
              enforce_eager=job["enforce_eager"], seed=job["seed"], skip_tokenizer_init=True,
              kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=False)
    print(STAGE_MARK + "engine_ready", flush=True)

    warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids in job["warmup_prompts"]], warmup, use_tqdm=False)
    print(STAGE_MARK + "warmup_done", flush=True)

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=job["ignore_eos"]) for n in job["max_tokens"]]
    repeats, samples = [], []
    for batch in job["batches"]:
        start_s = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start_s
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        repeats.append({
            "elapsed_s": elapsed_s,
            "generated_tokens": sum(len(ids) for ids in token_ids),
            "ttft_s": [out.metrics.first_token_latency for out in outputs
                       if out.metrics is not None and out.metrics.first_token_latency > 0],
            # Lets the table say whether a variant produced the very same greedy tokens as `off`.
            "tokens_digest": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(),
        })
        samples = samples or token_ids[:SAMPLE_RESPONSES]
    print(STAGE_MARK + "timed_done", flush=True)
    Path(job["result_path"]).write_text(json.dumps({"repeats": repeats, "sample_token_ids": samples}))


# --------------------------------------------------------------------------------------------
# Driver side.

def engine_env(args: argparse.Namespace, variant: str, device: str) -> dict[str, str]:
    env = variant_env(variant, args.min_tokens)
    if device == "cpu":
        # One OpenMP thread-set per TP rank; "auto" works for a single rank.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(args.tp)) if args.tp > 1 else "auto"
    return env


def run_variant(args, variant: str, env: dict, workload: dict, workdir: Path, stage_bar) -> dict:
    job_path, result_path = workdir / f"{variant}.job.json", workdir / f"{variant}.result.json"
    log_path = workdir / f"{variant}.log"
    cache = REPO_ROOT / ".cache"
    # Cache dirs go in as defaults so that a caller's own cache locations win.
    env_defaults = {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                "PYTHONUNBUFFERED": "1"}
    job = {"env": env, "env_defaults": env_defaults, "model": str(args.model), "tp": args.tp,
           "dtype": args.dtype, "enforce_eager": args.enforce_eager, "seed": args.seed,
           "result_path": str(result_path), **workload}
    job_path.write_text(json.dumps(job))
    tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
    start_s = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    ) as proc:
        # A hung engine must not hang the whole A/B: kill it and record the variant as failed.
        watchdog = threading.Timer(args.variant_timeout_s, proc.kill)
        watchdog.start()
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip())
            if line.startswith(STAGE_MARK):
                stage_bar.set_postfix_str(line[len(STAGE_MARK):].strip())
                stage_bar.update(1)
        watchdog.cancel()
    record = {"name": variant, "env": env, "log": str(log_path),
              "wall_s": round(time.perf_counter() - start_s, 1)}
    if proc.returncode != 0 or not result_path.is_file():
        timed_out = " (killed after --variant-timeout-s)" if proc.returncode == -9 else ""
        return record | {"status": "failed",
                         "error": f"exit code {proc.returncode}{timed_out}:\n" + "\n".join(tail)}
    return record | {"status": "ok", **json.loads(result_path.read_text())}


def summarize(record: dict, expected_tokens: int | None) -> dict:
    """Tokens/s of the fastest repeat: other load on the machine only ever slows a run down.

    expected_tokens: what ignore_eos makes every repeat generate; None where requests stop at EOS.
    """
    if record["status"] != "ok":
        return record
    repeats = record.pop("repeats")
    bad = [r["generated_tokens"] for r in repeats
           if expected_tokens is not None and r["generated_tokens"] != expected_tokens]
    if bad:
        return record | {"status": "failed", "error": f"generated {bad[0]} tokens, expected "
                         f"{expected_tokens} (ignore_eos should make every variant equal)"}
    rates = [r["generated_tokens"] / r["elapsed_s"] for r in repeats]
    best = repeats[max(range(len(repeats)), key=rates.__getitem__)]
    ttft_ms = sorted(1000 * t for t in best["ttft_s"])
    record["generated_tokens"] = best["generated_tokens"]
    record["elapsed_s"] = best["elapsed_s"]
    record["tokens_per_s"] = max(rates)
    record["tokens_per_s_repeats"] = rates
    record["ttft_ms"] = statistics.fmean(ttft_ms) if ttft_ms else None
    record["ttft_p50_ms"] = _percentile(ttft_ms, 50)
    record["ttft_p99_ms"] = _percentile(ttft_ms, 99)
    record["tokens_digest"] = hashlib.sha256("".join(r["tokens_digest"] for r in repeats).encode()).hexdigest()
    return record


def _percentile(sorted_values: list[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, math.ceil(pct / 100 * len(sorted_values)) - 1)]


def add_ratios(records: list[dict]) -> None:
    off = next((r for r in records if r["name"] == "off" and r["status"] == "ok"), None)
    for r in records:
        r["ratio_vs_off"] = r["tokens_per_s"] / off["tokens_per_s"] if off and r["status"] == "ok" else None
        r["same_tokens_as_off"] = (r["tokens_digest"] == off["tokens_digest"]
                                   if off and r["status"] == "ok" else None)


def format_table(records: list[dict]) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = ("variant", "tokens/s", "vs off", "TTFT ms", "p50", "p99", "tokens", "=off", "status")
    rows = [header]
    for r in records:
        same = {True: "yes", False: "NO", None: "-"}[r.get("same_tokens_as_off")]
        status = r["status"] if r["status"] != "skipped" else f"skipped: {r['reason']}"
        rows.append((r["name"], num(r.get("tokens_per_s"), ".1f"), num(r.get("ratio_vs_off"), ".3f"),
                     num(r.get("ttft_ms"), ".1f"), num(r.get("ttft_p50_ms"), ".1f"),
                     num(r.get("ttft_p99_ms"), ".1f"), num(r.get("generated_tokens"), "d"), same, status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def plot(records: list[dict], setup: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in records]
    ratios = [r["ratio_vs_off"] or 0.0 for r in records]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(names) + 2), 4.2))
    colors = ["tab:blue" if r["ratio_vs_off"] else "lightgray" for r in records]
    bars = ax.bar(names, ratios, color=colors)
    for bar, r in zip(bars, records):
        label = (f"{r['ratio_vs_off']:.3f}\n{r['tokens_per_s']:.0f} tok/s" if r["ratio_vs_off"]
                 else r["status"] if r["status"] != "ok" else "no off run")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--", zorder=0)
    ax.set_ylabel("tokens/s relative to off")
    ax.set_xlabel("variant")
    ax.set_ylim(0, max([1.0, *ratios]) * 1.3)
    mode = "eager" if setup["enforce_eager"] else "compiled"
    ax.set_title(f"Offline tokens/s relative to off\n{setup['model_name']} ({setup['arch']}), "
                 f"tp={setup['tp']}, {setup['dtype']}, {mode}, {setup['device']} ({setup['cpu_model']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_setup(args: argparse.Namespace, model_config: dict, device: str, workload: dict) -> dict:
    from rollout_ext import platform as rx_platform

    return {
        **rx_platform.versions(),
        "device": device,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "model": str(args.model),
        "model_name": Path(args.model).name,
        "arch": (model_config.get("architectures") or ["?"])[0],
        "tp": args.tp,
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "workload": args.workload,
        # Known in advance only where ignore_eos fixes every length.
        "output_tokens_per_batch": sum(workload["max_tokens"]) if workload["ignore_eos"] else None,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="HF checkpoint dir (default: tiny qwen2 for --workload random, the trained arithmetic "
                        "model for arith; built on demand)")
    p.add_argument("--workload", default="random", help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (--output-dist fixed)")
    p.add_argument("--output-dist", default="fixed", help="fixed | longtail (lognormal, seeded)")
    p.add_argument("--output-mean", type=int, default=128, help="mean output tokens (longtail)")
    p.add_argument("--output-cap", type=int, default=1024, help="max output tokens (longtail)")
    p.add_argument("--output-sigma", type=float, default=1.0, help="lognormal sigma (longtail)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graphs")
    p.add_argument("--variants", default="off,rope_cache,all",
                   help=f"comma-separated; known: {', '.join(known_variants())}; combine with '+'")
    p.add_argument("--min-tokens", type=int, default=None, help="mc2/flashcomm min tokens per step (default: unset)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed batches per engine, each on fresh prompts; the fastest one is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant-timeout-s", type=int, default=1200, help="kill an engine that runs longer")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    p.add_argument("--keep-logs", type=Path, default=None, help="keep per-variant engine logs in this dir")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        try:
            validate(args)
        except UsageError as err:
            p.error(str(err))
    return args


def validate(args: argparse.Namespace) -> None:
    for flag in ("num_prompts", "input_len", "output_len", "output_mean", "output_cap", "tp", "min_tokens",
                 "repeats", "variant_timeout_s"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: {value} is not allowed; use an integer >= 1")
    if args.workload not in WORKLOADS:
        raise UsageError(f"--workload: {args.workload!r} is not allowed; use one of {', '.join(WORKLOADS)}")
    if args.output_dist not in ("fixed", "longtail"):
        raise UsageError(f"--output-dist: {args.output_dist!r} is not allowed; use fixed or longtail")
    if args.output_dist == "longtail" and args.output_mean >= args.output_cap:
        raise UsageError(f"--output-mean: {args.output_mean} must be below --output-cap {args.output_cap}")
    if not args.output_sigma > 0:
        raise UsageError(f"--output-sigma: {args.output_sigma} is not allowed; use a number > 0")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: {args.dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--variants: {args.variants!r} names no variant; known: {', '.join(known_variants())}")
    if len(set(names)) != len(names):
        raise UsageError(f"--variants: {args.variants!r} repeats a variant")
    for name in names:
        check_variant_conflicts(name, variant_env(name, args.min_tokens))
    args.variants = names
    if args.model is not None and not (args.model / "config.json").is_file():
        raise UsageError(f"--model: {str(args.model)!r} has no config.json; pass a HF checkpoint dir")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args.worker)
        return 0
    from tqdm import tqdm

    from rollout_ext.platform import device_type

    if args.model is None and args.workload == "arith":
        from rollout_ext.testing.arith_model import build_arith_model, default_arith_dir

        args.model = build_arith_model(default_arith_dir())
    elif args.model is None:
        args.model = build_tiny_model(default_model_dir("qwen2"), arch="qwen2")
    model_config = json.loads((args.model / "config.json").read_text())
    workload = make_workload(args, model_config["vocab_size"])
    max_len = max(len(p) for p in workload["batches"][0]) + max(workload["max_tokens"])
    if max_len > model_config.get("max_position_embeddings", max_len):
        raise SystemExit(f"--input-len: {args.input_len} plus the longest output exceeds the model's "
                         f"max_position_embeddings {model_config['max_position_embeddings']}")
    device = device_type()
    setup = describe_setup(args, model_config, device, workload)
    print("setup:", json.dumps({k: v for k, v in setup.items() if k != "args"}))

    records = []
    with tempfile.TemporaryDirectory(prefix="offline_bench_") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for variant in tqdm(args.variants, desc="variants", unit="variant"):
            env = engine_env(args, variant, device)
            npu_only = NPU_ONLY_MODULES.intersection(variant_modules(variant) or ())
            if npu_only and device != "npu":
                records.append({"name": variant, "env": env, "status": "skipped", "reason": "NPU only"})
                continue
            with tqdm(total=len(STAGES), desc=f"  {variant}", unit="stage", leave=False) as stage_bar:
                record = run_variant(args, variant, env, workload, workdir, stage_bar)
            if args.keep_logs is None:
                record.pop("log")
            records.append(summarize(record, setup["output_tokens_per_batch"]))
    add_ratios(records)
    for r in records:
        r.pop("tokens_digest", None)

    print(format_table(records))
    first = next((r for r in records if r["status"] == "ok"), None)
    if first is not None and args.workload == "arith":
        for prompt, response in zip(workload["batches"][0], first["sample_token_ids"]):
            print(f"sample response ({first['name']}): {decode_arith(prompt)}{decode_arith(response)}")
    for r in records:
        if r["status"] == "failed":
            print(f"\n[{r['name']}] failed:\n{r['error']}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"setup": setup, "variants": records}, indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(records, setup, args.plot)
    return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
