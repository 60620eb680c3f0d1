"""OpenAI wire format: request bodies (validated, unknown fields rejected) and response bodies.

Only what the engine can honour is accepted; a field we cannot honour (``n > 1``, ``logprobs``, penalties,
``echo``, ...) is a 400 naming that field rather than being silently ignored. Every number is bounded by what the
engine can hold (``sampling_params``' bounds; temperature by OpenAI's 0..2), floats must be finite, and text must
be valid Unicode (JSON can carry lone surrogates, which no tokenizer encodes).
Nebula extensions: ``segments`` (explicit PIC / regular token segments), ``pic_backend`` (per-request
override; JSON null turns PIC off), ``top_k``, ``ignore_eos``, ``stop_token_ids``; ``usage.nebula``.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from nebula_engine.engine.sampling_params import (INT64_MAX, INT64_MIN, MAX_STOP_CHARS, MAX_STOP_SEQUENCES,
                                                  MAX_TOKEN_ID, MAX_TOP_K, check_unicode)

# ---- requests ----


def _valid_unicode(text: str) -> str:
    try:
        check_unicode("text", text)
    except ValueError as exc:  # its message names only a code point and an index: safe as a template
        raise PydanticCustomError("invalid_unicode", str(exc)) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]  # the engine checks the vocabulary itself
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenCount = Annotated[int, Field(ge=1, le=INT64_MAX)]  # the context length is checked against the prompt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Segment(_Strict):
    kind: Literal["regular", "pic"]
    token_ids: list[TokenId]


class SamplingFields(_Strict):
    model: Text
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)], None] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[Text] = None  # accepted and ignored, as OpenAI documents it (end-user id for abuse tracking)
    pic_backend: Optional[Text] = None  # absent: the engine's default; null: PIC off for this request
    prefill_peer: Optional[Text] = None  # cluster only: run the combine prefill on this peer (debugging, tests)

    @model_validator(mode="after")
    def _only_supported(self):
        if self.n != 1:
            raise unsupported("n", "only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise unsupported(name, f"{name} is not supported (must be 0)")
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[Text, list[TokenId], list[Text], None] = None
    segments: Optional[list[Segment]] = None  # given: the prompt is these segments; ``prompt`` is ignored
    max_tokens: Optional[TokenCount] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[Text] = None

    @model_validator(mode="after")
    def _completion_only_supported(self):
        if self.prompt is None and self.segments is None:
            raise unsupported("prompt", "prompt is required (or nebula's segments)")
        if self.segments is None and isinstance(self.prompt, list) and self.prompt \
                and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise unsupported("prompt", "a list of strings must hold exactly one prompt (no batching)")
        if self.segments is not None and not self.segments:
            raise unsupported("segments", "segments must not be empty")
        for name, asked in (("logprobs", self.logprobs is not None), ("echo", self.echo),
                            ("best_of", self.best_of not in (None, 1)), ("suffix", self.suffix is not None)):
            if asked:
                raise unsupported(name, f"{name} is not supported")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    name: Optional[Text] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[TokenCount] = None  # None: as many as the context allows
    max_completion_tokens: Optional[TokenCount] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = None

    @model_validator(mode="after")
    def _chat_only_supported(self):
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs are not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise unsupported("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def unsupported(param: str, message: str) -> PydanticCustomError:
    """A well-formed field whose value the server does not support; the error's ``ctx["param"]`` names it."""
    return PydanticCustomError("unsupported_value", message, {"param": param})


# ---- responses ----


class NebulaUsage(BaseModel):
    """How the prompt's cached tokens split; ``recomputed_tokens`` is part of ``pic_cached_tokens``."""

    prefix_cached_tokens: int
    pic_cached_tokens: int
    recomputed_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    nebula: NebulaUsage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nebula-engine"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
