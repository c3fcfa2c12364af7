"""A vLLM logits processor that ends a sequence with EOS at a total length chosen by the benchmark (test-only).

Random-weight tiny models almost never emit EOS, so a real-replica benchmark needs another way to
give each sequence its workload length. The benchmark sets, per request,
`sampling_params.extra_args = {"eos_at_total": prompt_len + length, "eos_id": EOS}`. This
processor masks EOS until prompt + output reaches `eos_at_total - 1` tokens, then allows only
EOS. The target is a *total* length, so it survives chunked continuation unchanged (a
continuation's prompt is the original prompt plus the tokens so far) and so do moves.

The router never sees it: the chunked client sends the router only the token cap.
Engine arg: `logits_processors=[FQCN]` ("module:qualname").
"""

from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FQCN = "rollout_ext.testing.forced_length:ForcedLengthLogitsProcessor"


class ForcedLengthLogitsProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        extra = params.extra_args or {}
        if "eos_at_total" not in extra:
            return None
        target = int(extra["eos_at_total"])
        eos = int(extra["eos_id"])

        def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if len(prompt_ids) + len(output_ids) + 1 >= target:
                keep = logits[eos].clone()
                logits.fill_(float("-inf"))
                logits[eos] = keep
            else:
                logits[eos] = float("-inf")
            return logits

        return force
