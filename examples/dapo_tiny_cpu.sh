#!/usr/bin/env bash
# DAPO training on CPU with rollout.name=rollout_ext, through `python -m verl.trainer.main_ppo`
# (see examples/dapo_train_cpu.py for what runs and what it reports).
# Usage: examples/dapo_tiny_cpu.sh --train [--steps 2] [--report out/dapo_train.json] [--profile-rollout DIR] ...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
test -f .cache/models/tiny-qwen2/config.json || $PYTHON -m rollout_ext.testing.tiny_model --arch qwen2 --out .cache/models/tiny-qwen2
# Ray maps 127.0.0.1 to the default route's address unless this is 0; keep everything on loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_CACHE_ROOT=$PWD/.cache/vllm TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
# --train is the only mode; it is kept as the word that says what runs.
if [[ "${1:-}" == "--train" ]]; then shift; fi
exec $PYTHON examples/dapo_train_cpu.py "$@"
