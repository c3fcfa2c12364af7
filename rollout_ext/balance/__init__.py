"""Tail-aware load balancing for synchronous RL rollout: pure Python + numpy, no Ray/vLLM/torch.

Modules:
- `request`: what a policy knows about a request.
- `policy`: the policy API (driven identically by the simulator and the verl router) and the
  simple policies round_robin, verl_default, oracle_lpt.
- `tail_aware`: tail_aware_placement and tail_aware (placement + chunk-boundary re-dispatch).
- `predictor`: online length predictor (siblings, per-prompt history, prompt-length prior,
  survival-style remaining length) and the oracle stand-in.
- `step_model`: decode step-time model of a replica and the makespan lower bound T*.
- `workload`: synthetic DAPO batch with long-tailed, group-correlated lengths.
- `simulator`: discrete-event simulator of R replicas.
"""
