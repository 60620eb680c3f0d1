"""What ``LLM.generate`` returns (vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token at one position: its log-probability under the model's unmodified logits, its rank
    among all tokens (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per generated token: the sampled token and the top k, token id -> Logprob
SampleLogprobs = list[dict[int, Logprob]]
# one entry per prompt token; the first is None (nothing predicts it)
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None unless logprobs were asked
    logprobs: SampleLogprobs | None = None  # None unless SamplingParams.logprobs was set
    finish_reason: str | None = None  # "stop" | "length" | "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # nebula-engine: each sampled token's logprob, always kept (cluster hand-offs carry them)
    token_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RequestTimes:
    """How long a request spent in each phase before its first token, in seconds (vLLM's queue and prefill time)."""

    queued: float  # from its arrival in the engine until it was first scheduled
    prefill: float  # from then until its first token was computed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None  # None unless SamplingParams.prompt_logprobs was set
    # cache hits: prompt tokens whose K/V existed before this request, prefix cache + PIC store (a cold segment
    # prefilled alone for this request and then combined is reused by the combine, but is no hit)
    num_cached_tokens: int = 0
    num_prefix_cached_tokens: int = 0  # part of num_cached_tokens: the prefix cache (exact)
    num_pic_cached_tokens: int = 0  # PIC segment tokens the combine reused at a new position (hits or fresh)
    num_recomputed_tokens: int = 0  # PIC-reused tokens the backend recomputed anyway (combine prefill)
    error: str | None = None  # set when the engine failed this request (finished, finish_reason "error")
    times: RequestTimes | None = None  # once it has a first token (None from engines that do not time requests)
