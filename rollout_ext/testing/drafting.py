"""What a suffix proposer reads from vLLM's InputBatch, for driving one without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

# A prompt and two responses that repeat themselves; the second has run a quarter as long.
PROMPT = [1, 2, 3]
LONG = PROMPT + [7, 8, 9, 10, 11, 12] * 6
SHORT = PROMPT + [7, 8, 9, 10, 11, 12, 7, 8, 9]


def input_batch(rows: list[list[int]], prompt_tokens: int, max_model_len: int = 1024) -> SimpleNamespace:
    """InputBatch's fields that SuffixDecodingProposer.propose reads: request ids, token ids, counts."""
    ids = [f"r{i}" for i in range(len(rows))]
    tokens = np.zeros((len(rows), max_model_len), dtype=np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    return SimpleNamespace(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                           num_tokens_no_spec=np.array([len(r) for r in rows]),
                           num_prompt_tokens=np.array([prompt_tokens] * len(rows)), token_ids_cpu=tokens)


def two_rows() -> tuple[SimpleNamespace, list[list[int]]]:
    """The batch of LONG and SHORT, and the tokens each sampled so far (the proposer's input)."""
    return input_batch([LONG, SHORT], len(PROMPT)), [LONG[len(PROMPT):], SHORT[len(PROMPT):]]
