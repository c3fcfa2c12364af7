#!/usr/bin/env bash
# Production DAPO on Ascend A2 (recorded settings; not run in CI): Qwen2.5-32B, 128 NPUs (16 nodes x 8),
# verl 0.9.1 v1 trainer, rollout through rollout_ext (vLLM + vllm-ascend with the rollout_ext plugin).
#
# Stages: Ulysses sequence parallel 4 while the mean response length is below 2.5K tokens, 8 after
# (longer sequences no longer fit the activations at SP 4). verl cannot change SP inside a run, so
# start with STAGE=short and, once response_length/mean crosses ~2500, resume from the last
# checkpoint with STAGE=long (trainer.resume_mode=auto picks it up).
#
# Usage (on the Ray head node, cluster already up):
#   STAGE=short MODEL=/models/Qwen2.5-32B DATA=/data/dapo examples/dapo_qwen25_32b_a2.sh
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${STAGE:-short}
MODEL=${MODEL:?path to Qwen2.5-32B}
DATA=${DATA:?directory with train.parquet and val.parquet}
case "$STAGE" in
  short) SP=4 ;;
  long) SP=8 ;;
  *) echo "STAGE must be short or long" >&2; exit 2 ;;
esac

# Replica environment: VLLM_PLUGINS=rollout_ext, TASK_QUEUE_ENABLE=2 (eager rollout), mc2 fused
# matmul+all-reduce for TP8, rope hoist; validated against conflicts by rollout_ext itself.
RUNTIME_ENV=$(mktemp --suffix=.yaml)
python -m rollout_ext env --preset dapo-a2-tp8 > "$RUNTIME_ENV"
export TASK_QUEUE_ENABLE=2   # the trainer processes too

R=actor_rollout_ref.rollout
A=actor_rollout_ref.actor
ray job submit --runtime-env "$RUNTIME_ENV" -- python -m verl.trainer.main_ppo \
  trainer.use_v1=True \
  trainer.nnodes=16 trainer.n_gpus_per_node=8 trainer.device=npu \
  trainer.total_epochs=1 trainer.save_freq=20 trainer.resume_mode=auto \
  trainer.project_name=dapo trainer.experiment_name=qwen25_32b_a2_sp${SP} \
  data.train_files=$DATA/train.parquet data.val_files=$DATA/val.parquet \
  data.train_batch_size=512 data.max_prompt_length=2048 data.max_response_length=20480 \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
  algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10 \
  actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.use_remove_padding=True \
  $A.clip_ratio_low=0.2 $A.clip_ratio_high=0.28 $A.loss_agg_mode=token-mean $A.use_kl_loss=False \
  $A.ppo_mini_batch_size=32 $A.use_dynamic_bsz=True $A.ppo_max_token_len_per_gpu=24576 \
  $A.ulysses_sequence_parallel_size=$SP \
  $A.fsdp_config.fsdp_size=128 $A.fsdp_config.forward_prefetch=True \
  $A.entropy_from_logits_with_chunking=True $A.entropy_checkpointing=True \
  $R.name=rollout_ext $R.n=16 $R.tensor_model_parallel_size=8 \
  $R.enable_chunked_prefill=True $R.max_num_batched_tokens=16384 $R.enforce_eager=True \
  $R.gpu_memory_utilization=0.85 $R.response_length=20480 $R.calculate_log_probs=True \
  reward.reward_manager.name=dapo \
  +reward.reward_kwargs.overlong_buffer_cfg.enable=True +reward.reward_kwargs.overlong_buffer_cfg.len=4096 \
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 +reward.reward_kwargs.overlong_buffer_cfg.log=False \
  +reward.reward_kwargs.max_resp_len=20480 \
  "$@"
