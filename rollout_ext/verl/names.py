"""The backend name users set (`actor_rollout_ref.rollout.name=rollout_ext`) and the one it stands in for."""

BACKEND = "rollout_ext"
# verl's own vLLM backend: every verl branch written for it should also take rollout_ext.
VLLM_BACKEND = "vllm"
