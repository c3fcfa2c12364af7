"""Balancing policies by name: the one table, and the one factory, that the verl router, the benches and
the tests share."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_ext.balance.policy import OracleLPTPolicy, Policy, RoundRobinPolicy, VerlDefaultPolicy
from rollout_ext.balance.predictor import HindsightPredictor, LengthPredictor, OraclePredictor, PredictorConfig
from rollout_ext.balance.step_model import StepModel
from rollout_ext.balance.tail_aware import TailAwareConfig, TailAwarePolicy
from rollout_ext.balance.workload import Workload, warm_history

# What a policy's predictor is given: nothing (no predictor), the online prediction, the true lengths,
# or the prediction at dispatch and the true remaining length once a sequence has started.
KNOWS = ("nothing", "prediction", "true_lengths", "hindsight")

# With exact survivor lengths the shipped move rule is far too cautious (CHANGELOG.md, 8face61:
# 0.966 in hindsight with it, 0.923 with these), so the hindsight yardstick moves on small gains.
HINDSIGHT_MOVES = {"move_margin": 0.003, "move_rem_factor": 1.0, "max_moves_per_request": 3}


@dataclass(frozen=True)
class PolicySpec:
    cls: type[Policy]
    knows: str  # one of KNOWS
    router: bool  # a verl router may run it (False: it needs the true lengths, simulator only)
    config: dict = field(default_factory=dict)  # TailAwareConfig fields it fixes

    def __post_init__(self) -> None:
        if self.knows not in KNOWS:
            raise ValueError(f"PolicySpec.knows={self.knows!r}; allowed: {', '.join(KNOWS)}")

    @property
    def predicted(self) -> bool:
        return self.knows != "nothing"


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(RoundRobinPolicy, "nothing", router=True),
    "verl_default": PolicySpec(VerlDefaultPolicy, "nothing", router=True),
    "tail_aware_placement": PolicySpec(TailAwarePolicy, "prediction", router=True, config={"redispatch": False}),
    "tail_aware": PolicySpec(TailAwarePolicy, "prediction", router=True),
    "oracle_lpt": PolicySpec(OracleLPTPolicy, "true_lengths", router=False),
    # Reference runs of tail_aware: with the true lengths, and with them once a sequence has started.
    "tail_aware_oracle": PolicySpec(TailAwarePolicy, "true_lengths", router=False),
    "tail_aware_hindsight": PolicySpec(TailAwarePolicy, "hindsight", router=False, config=HINDSIGHT_MOVES),
}
ROUTER_POLICIES = tuple(name for name, spec in POLICIES.items() if spec.router)


def make_policy(name: str, *, model: StepModel | None = None, slots_per_replica: int | None = None, seed: int = 0,
                tail_aware: dict | None = None, predictor_config: PredictorConfig | None = None,
                history: Workload | None = None, workload: Workload | None = None) -> Policy:
    """The policy `name`, given what its spec says it knows.

    model: the step model (TailAwarePolicy's prior; its max_num_seqs is the default slots); seed: tie-breaks;
    tail_aware: TailAwareConfig fields; predictor_config: the length predictor's; history: a finished
    epoch to warm the predictor with, as the trainer's previous step would; workload: the batch, whose
    true lengths the reference policies read (simulator only)."""
    spec = POLICIES.get(name)
    if spec is None:
        raise ValueError(f"policy={name!r}; allowed: {', '.join(POLICIES)}")
    model = model or StepModel()
    slots = slots_per_replica or model.max_num_seqs
    predictor = None
    if spec.knows in ("prediction", "hindsight"):
        predictor = LengthPredictor(predictor_config)
        if history is not None:
            warm_history(predictor, history)
    if spec.knows in ("true_lengths", "hindsight"):
        if workload is None:
            raise ValueError(f"policy={name!r} reads the true lengths: pass workload= (simulator only)")
        true = dict(zip(workload.request_ids, map(int, workload.lengths)))
        predictor = OraclePredictor(true) if spec.knows == "true_lengths" else HindsightPredictor(predictor, true)
    if spec.cls is TailAwarePolicy:
        config = TailAwareConfig(**{**(tail_aware or {}), **spec.config})
        policy = TailAwarePolicy(predictor=predictor, model=model, config=config, slots_per_replica=slots, seed=seed)
    else:
        policy = spec.cls(predictor=predictor, slots_per_replica=slots, seed=seed)
    policy.name = name
    return policy
