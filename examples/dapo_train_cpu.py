"""DAPO training on CPU, end to end: `python -m verl.trainer.main_ppo` with rollout.name=rollout_ext.

Each step is verl's own: rollout on 2 hybrid rollout_ext replicas behind TailAwareRouter (chunked
client), reward, DAPO's group filter, old log-prob,
actor update (FSDP2 over gloo, 2 ranks), weight sync into the replicas. The CPU platform for verl
comes from rollout_ext (VERL_PLATFORM=cpu); see docs/verl.md "Training on CPU".

Tasks (--task):
- arith (default): the trained arithmetic model (rollout_ext.testing.arith_model) on arithmetic
  problems, rewarded for a correct final answer (rollout_ext.testing.arith.compute_acc) plus DAPO's
  overlong penalty: a real RL task, where the reward can rise;
- vowel: the random-weight tiny Qwen2 and a toy reward (examples/vowel_reward.py), short responses:
  the fastest run, for checking the plumbing (weight sync, faults, profiling).

This script launches main_ppo as a child process group and watches it:
- one log line per phase (rollout_ext's phase log: gen, old_log_prob, update_actor, update_weights, ...)
  and a one-line summary per step;
- fail fast: if a replica or trainer process dies, or the child reports an error, the whole group
  is killed within seconds and the script exits 1, naming the step and phase;
- /dev/shm weight-transfer files the run created are removed on every exit path;
- --report PATH: JSON, one object per step, with verl's metric names.
Run it through examples/dapo_tiny_cpu.sh --train (the environment Ray needs to stay on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
SHM_PREFIXES = ("verl_weights_", "psm_", "sem.mp-")
PHASE = re.compile(r"rollout_ext phase: (?P<phase>\S+) (?P<what>start|end)")
ERROR = re.compile(r"(ActorDiedError|RayActorError|RayTaskError|Traceback \(most recent call last\)|"
                   r"OutOfMemoryError|Error executing job)")
# The processes whose death ends the run: verl's trainer workers and our replicas' servers.
WATCHED = ("ray::WorkerDict", "ray::RolloutExtHttpServer", "ray::TaskRunner")
SHUTDOWN_S = 60
PLUGIN_MARK = "rollout_ext 0.1.0: device="
# vLLM's periodic speculative decoding log line (vllm/v1/spec_decode/metrics.py), per replica.
SPEC_LOG = re.compile(r"SpecDecoding metrics: .*Accepted: (?P<accepted>\d+) tokens, Drafted: (?P<drafted>\d+) tokens")
HEARTBEAT_S = 30
# Report fields: verl's metric names (trainer/ppo/metric_utils.py, trainer/ppo/v1/utils.py).
METRICS = (
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "actor/grad_norm",
    "actor/pg_loss",
    "critic/rewards/mean",
    "critic/score/mean",
    "response_length/mean",
    "response_length/max",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    # async modes: a trajectory that spans more than one policy version was aborted and resumed
    "training/off_policy/trajectory_spans/max",
    "training/off_policy/trajectory_staleness/max",
)


def validation_overrides(args) -> list[str]:
    """Off, or sampled responses to a fixed held-out set before training and after every step: a
    measure of the policy that DAPO's group filter does not bias (the trained batch holds only groups
    whose samples disagree, so its reward stays near the middle whatever the policy learns)."""
    if args.val_prompts == 0:
        return ["trainer.val_before_train=False", "trainer.test_freq=-1"]
    kwargs = "actor_rollout_ref.rollout.val_kwargs"
    return ["trainer.val_before_train=True", "trainer.test_freq=1", f"{kwargs}.temperature=1.0",
            f"{kwargs}.do_sample=True", f"{kwargs}.n={args.val_n}"]


def val_metric(args) -> str | None:
    """verl's name for the held-out accuracy (trainer/ppo/v1/trainer_base.py, _validate)."""
    return f"val-core/{args.task}/acc/mean@{args.val_n}" if args.val_prompts else None


def train_overrides(args, data_dir: Path, router_yaml: Path) -> list[str]:
    from rollout_ext.verl.tiny_run import rollout_overrides

    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    batch = args.prompts_per_step
    overrides = [
        # Hybrid replicas are the trainer's ranks.
        *rollout_overrides(args.model, replicas=args.ranks, tp=1, response_length=args.response_length,
                           rollout_n=args.n, trainer_gpus_per_node=args.ranks),
        "trainer.use_v1=True",
        f"trainer.v1.trainer_mode={args.trainer_mode}",
        f"trainer.v1.colocate_async.num_warmup_batches={args.ahead_batches}",
        "trainer.device=cpu",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        f"data.seed={args.seed}",
        f"{rollout}.seed={args.seed}",
        *validation_overrides(args),
        "trainer.save_freq=-1",
        # Every step's responses as verl dumps them (`python -m rollout_ext spec-estimate` reads them).
        f"trainer.rollout_data_dir={args.workdir / 'rollouts'}",
        "trainer.logger=[console,file]",
        "trainer.project_name=rollout_ext",
        "trainer.experiment_name=dapo_tiny_cpu",
        f"trainer.default_local_dir={args.workdir / 'checkpoints'}",
        f"+ray_kwargs.ray_init.num_gpus={args.ranks}",
        "ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=False",
        # verl's runtime_env sets VLLM_LOGGING_LEVEL=WARN, which hides the plugin's status line per process.
        "+ray_kwargs.ray_init.runtime_env.env_vars={VLLM_LOGGING_LEVEL:INFO}",
        # DAPO
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        f"{actor}.use_kl_loss=False",
        f"{actor}.clip_ratio_low=0.2",
        f"{actor}.clip_ratio_high=0.28",
        f"{actor}.loss_agg_mode=token-mean",
        f"{actor}.strategy=fsdp2",
        f"{actor}.ppo_mini_batch_size={batch}",
        f"{actor}.ppo_micro_batch_size_per_gpu={batch * args.n // args.ranks}",
        f"{actor}.ppo_epochs=1",
        f"{actor}.optim.lr={args.lr}",
        f"{actor}.entropy_coeff=0",
        f"{actor}.fsdp_config.param_offload=False",
        # fp32 end to end, as the replicas run: the rollout/actor log-prob check then reads ~1e-6.
        f"{actor}.fsdp_config.dtype=float32",
        f"+{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"{actor}.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{rollout}.log_prob_micro_batch_size_per_gpu={batch * args.n // args.ranks}",
        # vLLM then logs its speculative decoding counters (the report's spec_decode).
        f"{rollout}.disable_log_stats={not args.tail_drafting}",
        f"{rollout}.temperature=1.0",
        f"{rollout}.router_config_path={router_yaml}",
        # data and reward
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={batch}",
        "data.dataloader_num_workers=0",
        "reward.reward_manager.name=dapo",
        # One reward worker and one transfer-queue storage unit (verl's defaults start 8 actors each).
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *TASKS[args.task]["reward"],
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        f"+reward.reward_kwargs.overlong_buffer_cfg.len={args.overlong_buffer}",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
        f"+reward.reward_kwargs.max_resp_len={args.response_length}",
    ]
    if args.profile_rollout:
        from rollout_ext.verl.profiling import phase_overrides

        overrides += phase_overrides("rollout", args.profile_rollout)
    return overrides


VAL_SEED = 10_000
TRAINER_MODES = ("sync", "colocate_async")  # the v1 modes that run on hybrid replicas
TASKS = {
    "arith": {"model": REPO / ".cache/models/arith-qwen2", "response_length": 256, "overlong_buffer": 64,
              "val_prompts": 64, "lr": 3e-4, "train_prompts": 256,
              "reward": [f"reward.custom_reward_function.path={REPO / 'examples' / 'arith_reward.py'}",
                         "reward.custom_reward_function.name=compute_acc"]},
    "vowel": {"model": REPO / ".cache/models/tiny-qwen2", "response_length": 16, "overlong_buffer": 4,
              "val_prompts": 0, "lr": 1e-3, "train_prompts": 64,
              "reward": [f"reward.custom_reward_function.path={REPO / 'examples' / 'vowel_reward.py'}"]},
}


def write_data(args, data_dir: Path) -> None:
    from rollout_ext.verl.tiny_run import write_arith_parquet, write_vowel_parquet

    write = write_arith_parquet if args.task == "arith" else write_vowel_parquet
    write(data_dir / "train.parquet", TASKS[args.task]["train_prompts"], seed=args.seed)
    # One held-out set for every seed, so that runs are measured on the same problems.
    write(data_dir / "val.parquet", max(8, args.val_prompts), seed=VAL_SEED)


def router_config(args, path: Path) -> dict:
    """examples/router_tail_aware.yaml with the chunk and slots sized for this tiny run, written to `path`."""
    import yaml

    config = yaml.safe_load((REPO / "examples" / "router_tail_aware.yaml").read_text())
    config.update(chunk_tokens=args.chunk_tokens, slots_per_replica=32, default_max_tokens=args.response_length)
    path.write_text(yaml.safe_dump(config))
    return config


def child_env(args) -> dict[str, str]:
    from rollout_ext.config import environ_copy

    env = environ_copy()
    env.update({
        "VERL_PLATFORM": "cpu",
        "VLLM_PLUGINS": "rollout_ext",
        "VERL_FILE_LOGGER_PATH": str(args.workdir / "metrics.jsonl"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_DEDUP_LOGS": "0",
        "VERL_LOGGING_LEVEL": "WARN",
        "TOKENIZERS_PARALLELISM": "false",
    })
    if args.control_no_sync:
        # A test-only patch of verl, kept under tests/: every verl process imports it by name.
        support = Path(__file__).resolve().parents[1] / "tests" / "support"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(support), env.get("PYTHONPATH", "")) if p)
        env["VERL_USE_EXTERNAL_MODULES"] = "skip_weight_sync"
    # The replicas' vLLM processes read it (Ray's workers inherit this environment).
    env["ROLLOUT_EXT_TAIL_DRAFTING"] = "1" if args.tail_drafting else "0"
    return env


class Watch:
    """What the child has said so far: the current phase, errors, and the watched processes."""

    def __init__(self):
        self.step, self.phase = 0, "startup"
        self.steps_done, self.done_at = 0, 0.0
        self.error: str | None = None
        self.plugin_lines: set[str] = set()  # the plugin's status line, once per vLLM process
        self.spec_decode = {"accepted_tokens": 0, "draft_tokens": 0}  # summed over vLLM's log lines
        self.lines: list[str] = []
        self.watched: dict[int, str] = {}
        self.lock = threading.Lock()

    def read(self, stream, log) -> None:
        for line in stream:
            log.write(line)
            log.flush()
            with self.lock:
                self.lines.append(line)
                del self.lines[:-200]
            match = PHASE.search(line)
            if match:
                if match["phase"] == "step":
                    if match["what"] == "start":
                        self.step += 1
                    else:
                        self.steps_done, self.done_at = self.step, time.monotonic()
                elif match["what"] == "start":
                    self.phase = match["phase"]
                    print(f"[step {self.step}] {self.phase} ...", flush=True)
                continue
            if PLUGIN_MARK in line:
                self.plugin_lines.add(line.split("] ", 1)[-1].strip())
            elif spec := SPEC_LOG.search(line):
                self.spec_decode["accepted_tokens"] += int(spec["accepted"])
                self.spec_decode["draft_tokens"] += int(spec["drafted"])
            elif self.error is None and ERROR.search(line):
                self.error = line.strip()


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            names[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = names.get(child, "")
            todo.append(child)
    return found


def shm_files() -> set[str]:
    """verl's weight-transfer files, plus the shared-memory segments vLLM and Python multiprocessing
    leave behind when Ray kills their processes at shutdown."""
    if not SHM.is_dir():
        return set()
    return {p.name for p in SHM.iterdir() if p.name.startswith(SHM_PREFIXES)}


def remove_orphans(names: set[str]) -> int:
    """Remove the files among `names` that no live process maps; returns how many."""
    mapped = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                maps = (entry / "maps").read_text()
            except OSError:
                continue
            mapped.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    removed = 0
    for name in names - mapped:
        try:
            (SHM / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def run(args) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    data_dir = args.workdir / "data"
    write_data(args, data_dir)
    metrics_path = args.workdir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    router_yaml = args.workdir / "router.yaml"
    router = router_config(args, router_yaml)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *train_overrides(args, data_dir, router_yaml)]
    (args.workdir / "command.txt").write_text(" ".join(cmd) + "\n")
    shm_before = shm_files()
    watch = Watch()
    started = time.monotonic()
    log_path = args.workdir / "main_ppo.log"
    print(f"main_ppo: {args.steps} steps, log {log_path}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        reader = threading.Thread(target=watch.read, args=(proc.stdout, log), daemon=True)
        reader.start()
        failure = None
        try:
            failure = supervise(proc, watch, args, started)
        except KeyboardInterrupt:
            failure = "interrupted"
        finally:
            if proc.poll() is None:
                kill_group(proc)
            reader.join(timeout=10)
            removed = remove_orphans(shm_files() - shm_before)
            print(f"/dev/shm: removed {removed} file(s) this run left", flush=True)
    steps = read_metrics(metrics_path)
    report = build_report(args, cmd, router, steps, watch, failure, time.monotonic() - started)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1))
    if failure:
        print(f"FAILED in step {watch.step}, phase {watch.phase}: {failure}", file=sys.stderr, flush=True)
        tail = "".join(watch.lines[-30:])
        print(tail, file=sys.stderr)
        return 1
    if len(steps) < args.steps:
        print(f"FAILED: main_ppo exited 0 after {len(steps)} of {args.steps} steps", file=sys.stderr)
        return 1
    return 0


def supervise(proc, watch: Watch, args, started: float) -> str | None:
    """Poll until the child exits; return why it failed, or None."""
    last_note = (watch.step, watch.phase, time.monotonic())
    while True:
        step, phase, since = last_note
        if (watch.step, watch.phase) != (step, phase):
            last_note = (watch.step, watch.phase, time.monotonic())
        elif time.monotonic() - since > HEARTBEAT_S:
            print(f"[step {step}] {phase} ... still running ({time.monotonic() - started:.0f} s since launch)",
                  flush=True)
            last_note = (step, phase, time.monotonic())
        rc = proc.poll()
        if rc is not None:
            return None if rc == 0 else f"main_ppo exited {rc}" + (f" ({watch.error})" if watch.error else "")
        if watch.error is not None:
            return f"error reported: {watch.error}"
        if time.monotonic() - started > args.timeout_s:
            return f"timed out after {args.timeout_s} s"
        alive = {pid: cmd for pid, cmd in descendants(proc.pid).items() if cmd.startswith(WATCHED)}
        if watch.steps_done >= args.steps:
            # Training is over: processes now exit as verl shuts down. Give it a minute.
            if time.monotonic() - watch.done_at > SHUTDOWN_S:
                kill_group(proc)
                return None
            time.sleep(1.0)
            continue
        for pid, cmd in watch.watched.items():
            if pid not in alive:
                return f"process {pid} ({cmd.split()[0]}) died"
        # A process counts once it has been seen: replicas start after the trainer's workers.
        watch.watched.update(alive)
        time.sleep(1.0)


def kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_report(args, cmd: list[str], router: dict, steps: list[dict], watch: Watch, failure: str | None,
                 wall_s: float) -> dict:
    rows = []
    for entry in steps:
        data = entry["data"]
        row = {"step": entry["step"], **{name: data.get(name) for name in METRICS}}
        row["val_acc"] = data.get(val_metric(args)) if val_metric(args) else None
        # The trained batch holds only kept groups (verl refills what the filter evicts).
        row["kept_groups"] = args.prompts_per_step
        row["filtered_groups"] = data.get("training/filter_groups/evicted_samples", 0)
        row["router"] = {k.removeprefix("rollout_ext/router_"): v for k, v in data.items()
                         if k.startswith("rollout_ext/router_")}
        rows.append(row)
        print(summary_line(row), flush=True)
    traces = sorted(str(p) for p in args.profile_rollout.rglob("*") if p.is_file()) if args.profile_rollout else []
    return {
        "plugin_lines": sorted(watch.plugin_lines),
        "spec_decode": watch.spec_decode,
        "rollout_traces": traces,
        "rollout_dump": str(args.workdir / "rollouts"),
        "command": " ".join(cmd),
        "task": args.task,
        "model": str(args.model),
        "seed": args.seed,
        "lr": args.lr,
        "router_class": router["router_class"],
        "router_policy": router["policy"],
        "trainer_mode": args.trainer_mode,
        "control_no_sync": args.control_no_sync,
        "failure": failure,
        "failed_step": watch.step if failure else None,
        "failed_phase": watch.phase if failure else None,
        "wall_s": round(wall_s, 1),
        "steps": rows,
    }


def summary_line(row: dict) -> str:
    def num(name, fmt=".3g"):
        value = row.get(name)
        return "-" if value is None else format(value, fmt)

    held_out = "" if row.get("val_acc") is None else f"  held-out acc {row['val_acc']:.3f}"
    return (f"step {row['step']}: reward {num('critic/score/mean')}{held_out}  length {num('response_length/mean', '.1f')}"
            f"  probs_diff_max "
            f"{num('training/rollout_probs_diff_max')}  grad_norm {num('actor/grad_norm')}  gen "
            f"{num('timing_s/gen', '.1f')} s  update {num('timing_s/update_actor', '.1f')} s  sync "
            f"{num('timing_s/update_weights', '.1f')} s  router moves {row['router'].get('moves', '-')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=tuple(TASKS), default="arith",
                        help="arith: the trained arithmetic model, correctness reward; vowel: random weights, toy reward")
    parser.add_argument("--model", default=None, help="default: the task's model (built by make setup)")
    parser.add_argument("--seed", type=int, default=0, help="data order, prompts and sampling")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trainer-mode", choices=TRAINER_MODES, default="sync",
                        help="verl's v1 trainer: sync, or colocate_async (one batch sampled ahead; the "
                             "unfinished samples are aborted at each weight sync and resumed after it)")
    parser.add_argument("--ahead-batches", type=float, default=1,
                        help="colocate_async: batches sampled ahead of training (verl's num_warmup_batches)")
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks = hybrid rollout replicas")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (DAPO group size)")
    parser.add_argument("--response-length", type=int, default=None, help="default: arith 256, vowel 16")
    parser.add_argument("--overlong-buffer", type=int, default=None, help="default: arith 64, vowel 4")
    parser.add_argument("--chunk-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None, help="default: arith 3e-4, vowel 1e-3; 0: the control "
                                                               "run, no learning")
    parser.add_argument("--val-prompts", type=int, default=None,
                        help="held-out prompts sampled before training and after every step (0: off; "
                             "default: arith 64, vowel 0)")
    parser.add_argument("--val-n", type=int, default=4, help="samples per held-out prompt, temperature 1")
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--workdir", type=Path, default=REPO / "out/dapo_train")
    parser.add_argument("--report", default=str(REPO / "out/dapo_train.json"))
    parser.add_argument("--profile-rollout", metavar="DIR", type=Path,
                        help="trace step 1's rollout on replica 0 (verl's rollout profiler, torch/npu tool)")
    parser.add_argument("--tail-drafting", action="store_true",
                        help="replicas draft with suffix decoding in the tail (ROLLOUT_EXT_TAIL_DRAFTING=1)")
    parser.add_argument("--control-no-sync", action="store_true",
                        help="control run: no weight sync after step 1, so from step 3 on rollout_probs_diff must grow")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    args.model = args.model or str(task["model"])
    if args.response_length is None:
        args.response_length = task["response_length"]
    if args.overlong_buffer is None:
        args.overlong_buffer = task["overlong_buffer"]
    if not 0 < args.overlong_buffer <= args.response_length:
        parser.error(f"--overlong-buffer={args.overlong_buffer} is not allowed; use 1..--response-length "
                     f"({args.response_length})")
    if args.lr is None:
        args.lr = task["lr"]
    if args.lr < 0:
        parser.error(f"--lr={args.lr} is not allowed; use a number >= 0 (0: the control run, no learning)")
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model={args.model} has no config.json; `make setup` builds the task's model")
    if args.val_prompts is None:
        args.val_prompts = task["val_prompts"]
    if args.val_prompts < 0:
        parser.error(f"--val-prompts={args.val_prompts} is not allowed; use an integer >= 0")
    for name in ("steps", "ranks", "prompts_per_step", "n", "response_length", "chunk_tokens", "val_n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed; use an integer >= 1")
    args.workdir = args.workdir.resolve()
    if args.profile_rollout:
        args.profile_rollout = args.profile_rollout.resolve()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
