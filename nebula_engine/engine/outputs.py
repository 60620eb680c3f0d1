"""What ``LLM.generate`` returns (vLLM's ``RequestOutput`` / ``CompletionOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token under the unmodified logits
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
