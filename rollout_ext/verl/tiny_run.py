"""A verl config, a local Ray cluster and a toy dataset for the tiny CPU model: shared by the CPU examples,
benches and tests.

Everything stays on this machine: Ray and the servers bind 127.0.0.1, the model and tokenizer are local files, and
the cluster declares as many logical GPUs as there are rollout replicas, because verl's standalone
replicas reserve one accelerator bundle per TP rank (vLLM itself runs on the CPU platform).
"""

from __future__ import annotations

import os
from pathlib import Path

from rollout_ext.verl.names import BACKEND

LOOPBACK = "127.0.0.1"


def rollout_overrides(model_dir: str | Path, *, replicas: int = 2, tp: int = 1, prompt_length: int = 64,
                      response_length: int = 32, rollout_n: int = 1, trainer_gpus_per_node: int = 1) -> list[str]:
    """Hydra overrides for verl's ppo_trainer config: tiny model, rollout_ext, CPU-sized engine."""
    max_model_len = prompt_length + response_length
    rollout = "actor_rollout_ref.rollout"
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"{rollout}.name={BACKEND}",
        f"{rollout}.nnodes=1",
        f"{rollout}.n_gpus_per_node={replicas * tp}",
        f"{rollout}.tensor_model_parallel_size={tp}",
        f"{rollout}.dtype=float32",
        f"{rollout}.enforce_eager=True",
        f"{rollout}.free_cache_engine=False",
        f"{rollout}.load_format=auto",
        f"{rollout}.prompt_length={prompt_length}",
        f"{rollout}.response_length={response_length}",
        f"{rollout}.max_model_len={max_model_len}",
        f"{rollout}.max_num_batched_tokens={max(256, max_model_len)}",
        f"{rollout}.max_num_seqs=32",
        f"{rollout}.n={rollout_n}",
        f"{rollout}.calculate_log_probs=True",
        f"{rollout}.agent.num_workers=1",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        f"trainer.n_gpus_per_node={trainer_gpus_per_node}",
        "trainer.nnodes=1",
    ]


def compose(overrides: list[str], config_name: str = "ppo_trainer"):
    """verl's own trainer config with overrides, as `python -m verl.trainer.main_ppo` would build it."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name, overrides=overrides)


def init_local_ray(num_gpus: int, env_vars: dict[str, str] | None = None) -> None:
    """A private Ray instance with `num_gpus` logical GPUs and no dashboard, on 127.0.0.1 only.

    Ray replaces 127.0.0.1 with the address of the default route unless the process was started
    with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read when ray is imported); examples/dapo_tiny_cpu.sh
    and the tests set it. Anything else is refused here rather than served on the network.
    """
    import ray

    ray.init(
        num_cpus=16,  # logical slots for actors; the real cores are shared
        num_gpus=num_gpus,
        include_dashboard=False,
        runtime_env={"env_vars": dict(env_vars or {})},
        log_to_driver=True,
    )
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {LOOPBACK}:
        ray.shutdown()
        raise RuntimeError(
            f"Ray bound {sorted(addresses)}, not {LOOPBACK}: start Python with "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in its environment"
        )


def write_vowel_parquet(path: str | Path, num_prompts: int, seed: int = 0) -> Path:
    """Prompts for examples/vowel_reward.py in verl's RLHFDataset layout (the reward reads no answer)."""
    import random

    import pandas as pd

    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "garden", "window", "planet", "music", "winter"]
    rows = []
    for index in range(num_prompts):
        word = rng.choice(words)
        rows.append({
            "data_source": "vowels",
            "prompt": [{"role": "user", "content": f"Say something about the {word} {index}."}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": index},
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def write_arith_parquet(path: str | Path, num_prompts: int, seed: int = 0) -> Path:
    """verl's RL dataset format for the arithmetic task (rollout_ext.testing.arith): the prompt is the
    problem, the ground truth its answer."""
    import pandas as pd

    from rollout_ext.testing import arith

    rows = [{
        "data_source": "arith",
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"index": index, "num_operands": problem.num_operands},
    } for index, problem in enumerate(arith.problems(seed, num_prompts))]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path
