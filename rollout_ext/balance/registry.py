"""Balancing policies by name: the one table that the verl router, the benches and the tests share."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_ext.balance.policy import OracleLPTPolicy, Policy, RoundRobinPolicy, VerlDefaultPolicy
from rollout_ext.balance.step_model import StepModel
from rollout_ext.balance.tail_aware import TailAwareConfig, TailAwarePolicy


@dataclass(frozen=True)
class PolicySpec:
    cls: type[Policy]
    predicted: bool  # takes a length predictor
    router: bool  # a verl router may run it (False: it needs the true lengths, simulator only)
    config: dict = field(default_factory=dict)  # TailAwareConfig fields it fixes


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(RoundRobinPolicy, predicted=False, router=True),
    "verl_default": PolicySpec(VerlDefaultPolicy, predicted=False, router=True),
    "tail_aware_placement": PolicySpec(TailAwarePolicy, predicted=True, router=True, config={"redispatch": False}),
    "tail_aware": PolicySpec(TailAwarePolicy, predicted=True, router=True),
    "oracle_lpt": PolicySpec(OracleLPTPolicy, predicted=True, router=False),
}
ROUTER_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.router)


def make_policy(name: str, *, predictor=None, model: StepModel | None = None, tail_aware: dict | None = None,
                slots_per_replica: int | None = None, seed: int = 0) -> Policy:
    """The policy `name`, built from what it takes: a predictor and the TailAwareConfig fields for the
    tail-aware ones, a step model (the prior) for TailAwarePolicy, slots and a tie-break seed for all."""
    spec = POLICIES.get(name)
    if spec is None:
        raise ValueError(f"policy={name!r}; allowed: {', '.join(POLICIES)}")
    model = model or StepModel()
    slots = slots_per_replica or model.max_num_seqs
    if spec.cls is TailAwarePolicy:
        config = TailAwareConfig(**{**(tail_aware or {}), **spec.config})
        return TailAwarePolicy(predictor=predictor, model=model, config=config, slots_per_replica=slots, seed=seed)
    if spec.predicted:
        return spec.cls(predictor=predictor, slots_per_replica=slots, seed=seed)
    return spec.cls(slots_per_replica=slots, seed=seed)
