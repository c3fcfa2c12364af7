"""What the balancing policy knows about a request: identity, group, prompt size and token cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str  # stable across chunks and turns of one sequence (sticky key)
    group_key: str  # same for all samples of one prompt in this batch (GRPO group)
    sample_index: int  # index of this sample within its group
    prompt_len: int  # prompt tokens
    max_tokens: int  # response cap; reaching it means truncation
    prompt_hash: str = ""  # hash of the prompt tokens, stable across epochs ("" = unknown)

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.max_tokens < 1:
            raise ValueError(f"Request {self.request_id}: prompt_len >= 0 and max_tokens >= 1 required")
