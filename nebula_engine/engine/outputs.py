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
    num_cached_tokens: int = 0  # prompt tokens whose K/V was reused: prefix cache + PIC store
    num_prefix_cached_tokens: int = 0  # part of num_cached_tokens: the prefix cache (exact)
    num_pic_cached_tokens: int = 0  # part of num_cached_tokens: PIC segments reused at a new position
    num_recomputed_tokens: int = 0  # PIC-reused tokens the backend recomputed anyway (combine prefill)
    error: str | None = None  # set when the engine failed this request (finished, finish_reason "error")
