"""What ``LLM.generate`` returns (vLLM's ``RequestOutput`` / ``CompletionOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token under the unmodified logits
    finish_reason: str | None = None  # "stop" | "length" | "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # cache hits: prompt tokens whose K/V existed before this request, prefix cache + PIC store (a cold segment
    # prefilled alone for this request and then combined is reused by the combine, but is no hit)
    num_cached_tokens: int = 0
    num_prefix_cached_tokens: int = 0  # part of num_cached_tokens: the prefix cache (exact)
    num_pic_cached_tokens: int = 0  # PIC segment tokens the combine reused at a new position (hits or fresh)
    num_recomputed_tokens: int = 0  # PIC-reused tokens the backend recomputed anyway (combine prefill)
    error: str | None = None  # set when the engine failed this request (finished, finish_reason "error")
