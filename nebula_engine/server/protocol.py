"""OpenAI wire format: request bodies (validated; unknown fields ignored, as vLLM does) and response bodies.

Requests carry what OpenAI's chat and completions APIs define as agents use them (content parts, tools,
``tool_choice``, ``role: "tool"`` messages, ``n``, logprobs, penalties, ``logit_bias``, ``response_format``)
plus vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``,
``truncate_prompt_tokens``, ``skip_special_tokens``, ``spaces_between_special_tokens``, ``return_tokens_as_token_ids``,
``request_id``, ``stream_options.continuous_usage_stats``; chat's ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``, ``echo``). A field this server does not know is accepted and ignored; the server names
such fields in one warning per request (``ignored_fields``), as vLLM does. An explicit JSON ``null`` means "absent"
for every optional field, as the OpenAI spec allows, except ``pic_backend`` where null turns PIC off. A known field
whose value we cannot honour (``best_of``, ``suffix``, image content) is a 400 naming that field rather than being
silently ignored. Every number is
bounded by what the engine can hold (``sampling_params``' bounds; OpenAI's ranges where it has them), floats
must be finite, and text must be valid Unicode (JSON can carry lone surrogates, which no tokenizer encodes).
Nebula extensions: ``segments`` (explicit PIC / regular token segments), ``pic_backend`` (per-request
override), ``prefill_peer`` (clusters); ``usage.nebula``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer,
                      model_validator)
from pydantic_core import PydanticCustomError

from nebula_engine.engine.sampling_params import (INT64_MAX, INT64_MIN, MAX_STOP_CHARS, MAX_STOP_SEQUENCES,
                                                  MAX_TOKEN_ID, MAX_TOP_K, check_unicode)
from nebula_engine.engine.tokenizer import RESERVED_TEMPLATE_KWARGS, ChatOptions

# OpenAI's API reference bounds: n "<= 128", top_logprobs "between 0 and 20", penalties "between -2.0 and 2.0",
# logit_bias values "from -100 to 100"; logprobs are capped by the server's --max-logprobs (vLLM's, default 20)
MAX_N = 128
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_BAD_WORDS = 1024  # each is checked against the output on every token; word lists in practice are far shorter
MAX_OPENAI_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
NULL_MEANS_SOMETHING = frozenset({"pic_backend"})  # null turns PIC off; every other null is "absent"

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
Penalty = Annotated[float, Field(ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY)]
JSONObject = dict[str, Any]


class _Strict(BaseModel):
    """Known fields are type-checked strictly; unknown fields are kept aside (``ignored_fields``) and ignored. An
    explicit null is the same as leaving the field out."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in NULL_MEANS_SOMETHING}
        return data


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """The dotted names of every field of ``model`` (and of the models inside it) that this server does not know."""
    names = [f"{path}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}{name}[{index}]." if isinstance(value, list) else f"{path}{name}."
                names += ignored_fields(item, where)
    return names


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk, not only on the last


class Segment(_Strict):
    kind: Literal["regular", "pic"]
    token_ids: list[TokenId]


class JSONSchemaFormat(_Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Optional[Text] = None
    schema_: JSONObject = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise unsupported("response_format", 'response_format of type "json_schema" needs a json_schema')
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one constraint on the output's text."""

    json_: Union[JSONObject, Text, None] = Field(None, alias="json")  # a JSON schema
    regex: Optional[Text] = None
    choice: Optional[list[Text]] = None
    grammar: Optional[Text] = None  # EBNF
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None  # JSON without free whitespace between tokens

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the engine's ``StructuredOutputsParams``."""
        return {("json" if k == "json_" else k): v for k, v in self if v is not None}


class SamplingFields(_Strict):
    model: Text
    request_id: Optional[Text] = Field(None, min_length=1, max_length=256)  # vLLM's: the base of the response id
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)], None] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0, le=INT64_MAX)  # vLLM: > 0; 1 = off
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    logit_bias: Optional[dict[StrictStr, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0)  # vLLM's: each prompt token's and top k (<= --max-logprobs)
    bad_words: Optional[Annotated[list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                                  Field(max_length=MAX_BAD_WORDS)]] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=INT64_MAX)  # keep the last k; -1: max_model_len
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's)
    user: Optional[Text] = None  # accepted and ignored, as OpenAI documents it (end-user id for abuse tracking)
    pic_backend: Optional[Text] = None  # absent: the engine's default; null: PIC off for this request
    prefill_peer: Optional[Text] = None  # cluster only: run the combine prefill on this peer (debugging, tests)

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise unsupported("prompt_logprobs", "prompt_logprobs are not available when streaming (as in vLLM)")
        if self.truncate_prompt_tokens == 0:
            raise unsupported("truncate_prompt_tokens", "truncate_prompt_tokens must be a positive number of tokens, "
                                                        "or -1 (the model's maximum length)")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise unsupported("structured_outputs", "give structured_outputs or response_format, not both")
        for key in self.logit_bias or {}:
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise unsupported("logit_bias", f"logit_bias keys must be token ids (decimal integers as strings), "
                                                f"got {key!r:.40}")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and (self.stream_options.include_usage or
                                                    self.stream_options.continuous_usage_stats)

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def token_logit_bias(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}


class CompletionRequest(SamplingFields):
    # one prompt or a batch, each text or token ids (vLLM's forms); a batch gives n choices per prompt
    prompt: Union[Text, list[TokenId], list[Text], list[list[TokenId]], None] = None
    segments: Optional[list[Segment]] = None  # given: the prompt is these segments; ``prompt`` is ignored
    max_tokens: Optional[Annotated[int, Field(ge=0, le=INT64_MAX)]] = 16  # 0 with echo: score the prompt only
    logprobs: Optional[int] = Field(None, ge=0)  # <= the server's --max-logprobs
    echo: bool = False  # the prompt is prepended to the text (and its tokens to the logprobs)
    best_of: Optional[int] = None
    suffix: Optional[Text] = None

    @model_validator(mode="after")
    def _completion_only_supported(self):
        if self.prompt is None and self.segments is None:
            raise unsupported("prompt", "prompt is required (or nebula's segments)")
        if self.segments is not None and not self.segments:
            raise unsupported("segments", "segments must not be empty")
        for name, asked in (("best_of", self.best_of not in (None, self.n)), ("suffix", self.suffix is not None)):
            if asked:
                raise unsupported(name, f"{name} is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise unsupported("max_tokens", "max_tokens may be 0 only with echo (to score the prompt)")
        return self

    @property
    def score_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch (one for a single prompt); ``segments`` requests have one, built elsewhere."""
        prompt = self.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))):
            return [prompt]
        return list(prompt)


def _message_content(content: Any) -> str | list[JSONObject]:
    """A string, or a list of content-part objects (``chat_messages`` accepts text parts and names any other)."""
    if isinstance(content, str):
        return _valid_unicode(content)
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise unsupported("messages", "content must be a string or a list of content-part objects")
    return content


MessageContent = Annotated[Any, AfterValidator(_message_content)]


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object, as a string (OpenAI's shape)


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[MessageContent] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant
    tool_call_id: Optional[Text] = None  # tool

    @model_validator(mode="after")
    def _fields_of_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            article = "an" if self.role[0] in "aeiou" else "a"
            raise unsupported("messages", f"{article} {self.role} message needs content (only an assistant message "
                                          "with tool_calls may leave it null)")
        if self.tool_calls is not None and self.role != "assistant":
            raise unsupported("messages", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise unsupported("messages", "a tool message needs the tool_call_id it answers")
        return self


class FunctionDefinition(_Strict):
    name: Text = Field(min_length=1, max_length=64)
    description: Optional[Text] = None
    parameters: Optional[JSONObject] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[TokenCount] = None  # None: as many as the context allows
    max_completion_tokens: Optional[TokenCount] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)  # <= the server's --max-logprobs
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[JSONObject] = None  # vLLM's: extra template variables (enable_thinking, ...)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the reply starts with the last message's content when that is the assistant's

    @model_validator(mode="after")
    def _chat_only_supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise unsupported("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise unsupported("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise unsupported("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                             f"one of the tools")
        forced_tool = self.effective_tool_choice not in ("none", "auto")
        if forced_tool and (self.structured_outputs is not None or
                            (self.response_format is not None and self.response_format.type != "text")):
            raise unsupported("tool_choice", "a forced tool_choice constrains the output itself: it cannot be "
                                             "combined with response_format or structured_outputs")
        _check_chat_options(self)
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise unsupported("continue_final_message", "continue_final_message needs the last message to be the "
                                                        "assistant's")
        return self

    @property
    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {})

    @property
    def echo_text(self) -> str:
        """What an ``echo`` reply starts with: the last message's text when it is the assistant's (vLLM's rule)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.get("text", "") for part in last.content if isinstance(part.get("text"), str))

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` when tools are given, ``none`` otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (completions) or ``messages`` (chat, through the template)."""

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Tool]] = None
    add_special_tokens: Optional[bool] = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[JSONObject] = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise unsupported("prompt", "give exactly one of prompt and messages")
        _check_chat_options(self)
        return self

    @property
    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {})


class DetokenizeRequest(_Strict):
    model: Optional[Text] = None
    tokens: list[TokenId]


def _check_chat_options(request: ChatCompletionRequest | TokenizeRequest) -> None:
    if request.add_generation_prompt and request.continue_final_message:
        raise unsupported("continue_final_message", "add_generation_prompt and continue_final_message cannot both "
                                                    "be true (set add_generation_prompt to false)")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(request.chat_template_kwargs or {}))
    if reserved:
        raise unsupported("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)} (each is "
                                                  f"a field of its own)")


def unsupported(param: str, message: str) -> PydanticCustomError:
    """A well-formed field whose value the server does not support; the error's ``ctx["param"]`` names it."""
    return PydanticCustomError("unsupported_value", message, {"param": param})


# ---- responses ----


class NebulaUsage(BaseModel):
    """How the prompt's reused tokens split: the prefix cache's hits, and where PIC ran (only then are they
    present) the PIC segment tokens reused at a new position, of which ``recomputed_tokens`` were recomputed."""

    prefix_cached_tokens: int
    pic_cached_tokens: Optional[int] = None
    recomputed_tokens: Optional[int] = None

    @model_serializer(mode="wrap")
    def _without_absent(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    nebula: NebulaUsage


class CompletionLogprobs(BaseModel):
    """Completions' (legacy) shape: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]  # vLLM's shape: one entry per prompt token, first None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's, when asked


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]  # {"name", "arguments"}


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's, when asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nebula-engine"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
