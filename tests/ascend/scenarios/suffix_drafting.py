"""Tail drafting on vllm-ascend main's AscendSuffixDecodingProposer. Run: suffix_drafting.py MODEL_DIR
(env carries ROLLOUT_EXT_TAIL_DRAFTING=1).

The plugin registers; vLLM builds an engine config for MODEL_DIR through EngineArgs (the plugin's
engine hook fills the speculative config); vllm-ascend's proposer is built from that config as its
get_spec_decode_method builds it, and called as NPUModelRunner.propose_draft_token_ids calls it
(keyword arguments, the scheduler's K). Then the plugin unregisters and the same call is the
control. Prints "SUFFIX <json>".
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lane  # noqa: E402

lane.enter()

from rollout_ext import plugin  # noqa: E402
from rollout_ext.testing import drafting  # noqa: E402

plugin.register()
state = plugin.module_states()["tail_drafting"]

import vllm.plugins  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup  # noqa: E402
from vllm_ascend.spec_decode import get_spec_decode_method  # noqa: E402

vllm.plugins.plugins_loaded = True  # registered above, under the lane
vllm_config = EngineArgs(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=32,
                         skip_tokenizer_init=True).create_engine_config()
spec = vllm_config.speculative_config
lookup = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, 32, spec.num_speculative_tokens)


def propose(step_tokens: int):
    batch, sampled = drafting.two_rows()
    proposer = get_spec_decode_method("suffix", vllm_config, "cpu", SimpleNamespace(input_batch=batch))
    try:
        return type(proposer).__name__, proposer.propose(num_speculative_tokens=step_tokens, sampled_token_ids=sampled)
    except AssertionError:
        return type(proposer).__name__, "AssertionError"


proposer, bound = propose(4)
_, full_batch = propose(0)
plugin.unregister()
_, control = propose(4)
print("SUFFIX " + json.dumps({"state": state.state, "stack": state.stack, "method": spec.method,
                              "k_by_batch": {n: lookup[n] for n in (1, 16, 17, 32)}, "proposer": proposer,
                              "bound": bound, "full_batch": full_batch, "control": control}), flush=True)
