"""bench/predictor_error.py: the error at dispatch falls with history, and the floor is what groups allow."""

import importlib.util
import sys

from rollout_ext.balance.predictor import LengthPredictor
from rollout_ext.balance.request import Request


def _bench(repo_root):
    spec = importlib.util.spec_from_file_location("predictor_error", repo_root / "bench" / "predictor_error.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["predictor_error"] = module
    spec.loader.exec_module(module)
    return module


def _epoch(epoch, lengths_by_prompt):
    requests, lengths = [], []
    for p, group in enumerate(lengths_by_prompt):
        for s, length in enumerate(group):
            requests.append(Request(f"{epoch}-{p}-{s}", f"{epoch}-{p}", s, 20, 512, f"prompt-{p}"))
            lengths.append(length)
    return requests, lengths


def test_history_brings_the_error_down_to_the_groups_floor(repo_root):
    bench = _bench(repo_root)
    # Every prompt has one length: the floor is 0, and history should find it.
    groups = [[10 + 7 * p] * 8 for p in range(16)]
    predictor = LengthPredictor()
    first = bench.epoch_error(predictor, *_epoch(0, groups))
    second = bench.epoch_error(predictor, *_epoch(1, groups))
    assert first["group_mean_floor"] == second["group_mean_floor"] == 0.0
    assert second["mean_abs_log_error"] < 0.25 < first["mean_abs_log_error"]
    # Control: siblings that differ leave a floor no predictor can beat.
    spread = [[5, 50] * 4 for _ in range(16)]
    assert bench.epoch_error(LengthPredictor(), *_epoch(0, spread))["group_mean_floor"] > 1.0


def test_the_synthetic_epochs_share_prompts_and_not_requests(repo_root):
    bench = _bench(repo_root)
    (old, _), (new, _) = bench.synthetic_epochs(4, 2, 2, seed=0)
    assert [r.prompt_hash for r in old] == [r.prompt_hash for r in new]
    assert not {r.request_id for r in old} & {r.request_id for r in new}
