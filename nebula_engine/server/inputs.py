"""Request body -> what the engine runs: prompts (token ids or ``SegmentedPrompt``s), ``SamplingParams``, PIC
backend, and how the outputs become choices.

Text prompts and chat messages always go through ``<pic>`` segmentation (untagged text is one regular
segment, so the ids equal plain tokenization); token-id prompts are taken as they are. Chat messages of every
kind (tool results included) are rendered by the model's chat template with the request's ``tools``. A forced
``tool_choice`` (``required`` or a named function) and ``response_format`` constrain the output with the
engine's structured outputs (a JSON schema, as vLLM does). Every problem is an ``APIError`` (400) naming the
offending field; fields the server does not know are named in one warning log line per request and ignored.

``echo`` (completions) asks the engine for the prompt's logprobs when logprobs are asked (``prompt_logprobs`` =
``logprobs``, as vLLM does); ``max_tokens: 0`` with it runs one token, which the response leaves out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from nebula_engine.engine.prompt_truncation import truncate_prompt
from nebula_engine.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.pic.segments import PICSyntaxError, SegmentedPrompt, segment_token_lists
from nebula_engine.server.chat_messages import template_messages, template_tools
from nebula_engine.server.engine_client import ENGINE_DEFAULT, EnginePrompt
from nebula_engine.server.errors import APIError
from nebula_engine.server.logprobs import TokenIdText
from nebula_engine.server.protocol import (ChatCompletionRequest, CompletionRequest, NamedToolChoice, SamplingFields,
                                           ignored_fields)
from nebula_engine.server.responses import ChoiceFormat
from nebula_engine.server.tool_parsers import NamedToolOutput, RequiredToolsOutput, ToolParser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputSettings:
    """Server-wide choices about outputs."""

    tool_parser: ToolParser | None = None  # the served model's tool-call format (None: it has none)
    # vLLM's structured-outputs option: constrained JSON (response_format, forced tool calls) has no free
    # whitespace between tokens, so a weak model cannot wander in whitespace until max_tokens
    disable_any_whitespace: bool = False
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: the most logprobs per token a request may ask


@dataclass(frozen=True)
class EngineInput:
    prompts: tuple[EnginePrompt, ...]  # one engine request each (a completions batch); each gives n choices
    params: SamplingParams
    pic_backend: str | None  # a backend spec, None (PIC off), or ENGINE_DEFAULT (the engine's)
    route: str | None = None  # cluster: the prefill peer that must run the combine
    form: ChoiceFormat = field(default_factory=ChoiceFormat)
    request_id: str | None = None  # the client's (vLLM's request_id), the base of the response id


def warn_ignored_fields(request: Any) -> None:
    """One warning naming the fields of ``request`` this server does not know (they are ignored, as vLLM does)."""
    names = ignored_fields(request)
    if names:
        logger.warning("The following fields were present in the request but ignored: %s", ", ".join(names))


def completion_input(request: CompletionRequest, tokenizer: Tokenizer, max_model_len: int,
                     settings: OutputSettings = OutputSettings()) -> EngineInput:
    warn_ignored_fields(request)
    _check_logprobs(request, settings, logprobs=("logprobs", request.logprobs))
    prompts = [truncate_prompt(p, request.truncate_prompt_tokens, max_model_len)
               for p in _completion_prompts(request, tokenizer)]
    max_tokens = 1 if request.score_only else request.max_tokens
    echo = tuple(_echo_text(request, p, tokenizer) for p in _echoed_prompts(request, prompts)) \
        if request.echo else None
    return _engine_input(request, prompts, "prompt", max_tokens, max_model_len, tokenizer,
                         logprobs=request.logprobs, structured=_structured(request, settings), echo=echo)


def chat_input(request: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int,
               settings: OutputSettings = OutputSettings()) -> EngineInput:
    warn_ignored_fields(request)
    _check_logprobs(request, settings, top_logprobs=("top_logprobs", request.top_logprobs))
    choice_parser, structured = _tool_choice(request, settings)
    try:
        prompt = tokenizer.segment_chat(template_messages(request.messages), template_tools(request.tools),
                                        request.chat_options)
    except PICSyntaxError as exc:
        raise APIError(f"bad <pic> markup: {exc}", param="messages", code="invalid_pic_tags") from exc
    except ValueError as exc:  # no chat template, or one that mangles PIC placeholders
        raise APIError(str(exc), param="messages") from exc
    except TemplateError as exc:  # the template's own checks (raise_exception): roles out of order, ...
        raise APIError(f"the chat template refused the messages: {exc}", param="messages") from exc
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt = truncate_prompt(prompt, request.truncate_prompt_tokens, max_model_len)
    return _engine_input(request, [prompt], "messages", request.max_output_tokens, max_model_len, tokenizer,
                         logprobs=logprobs, structured=structured or _structured(request, settings),
                         tool_parser=choice_parser, echo=(request.echo_text,) if request.echo_text else None)


def _check_logprobs(request: SamplingFields, settings: OutputSettings, **asked: tuple[str, int | None]) -> None:
    """Each logprobs count asked for is within the server's ``--max-logprobs``."""
    for param, value in [*asked.values(), ("prompt_logprobs", request.prompt_logprobs)]:
        if value is not None and value > settings.max_logprobs:
            raise APIError(f"{param} is {value}, above this server's limit of {settings.max_logprobs} "
                           f"(--max-logprobs)", param=param)


def _echoed_prompts(request: CompletionRequest, prompts: list[EnginePrompt]) -> list[str | EnginePrompt]:
    """Each prompt as the client gave it (its text) where that is what it was truncated from, else its tokens."""
    if request.segments is not None or request.truncate_prompt_tokens is not None:
        return prompts
    return [text if isinstance(text, str) else prompt for text, prompt in zip(request.prompts, prompts)]


def _echo_text(request: CompletionRequest, prompt: str | EnginePrompt, tokenizer: Tokenizer) -> str:
    """The text ``echo`` puts first: a text prompt as written (without its ``<pic>`` tags), token ids decoded."""
    if isinstance(prompt, str):
        return prompt.replace("<pic>", "").replace("</pic>", "")
    token_ids = prompt.token_ids if isinstance(prompt, SegmentedPrompt) else prompt
    return tokenizer.decode(list(token_ids), skip_special_tokens=request.skip_special_tokens)


def _tool_choice(request: ChatCompletionRequest, settings: OutputSettings
                 ) -> tuple[ToolParser | None, dict[str, Any] | None]:
    """(how the output is read, the constraint it is held to) for the request's ``tool_choice``."""
    choice = request.effective_tool_choice
    if choice == "none":
        return None, None
    if choice == "auto":
        if settings.tool_parser is None:
            raise APIError('tool_choice "auto" needs a tool call parser, and this model\'s chat template renders no '
                           'tool calls of a known format; start the server with --enable-auto-tool-choice '
                           '--tool-call-parser NAME (and --chat-template, for a template that renders tools), or use '
                           'tool_choice "required" or a named function', param="tool_choice")
        return settings.tool_parser, None
    compact = {"disable_any_whitespace": True} if settings.disable_any_whitespace else {}
    tools = {tool.function.name: tool.function.parameters or {"type": "object"} for tool in request.tools}
    if isinstance(choice, NamedToolChoice):
        return NamedToolOutput(choice.function.name), {"json": tools[choice.function.name], **compact}
    call = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"]} for name, schema in tools.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return RequiredToolsOutput(), {"json": schema, **compact}


def _structured(request: SamplingFields, settings: OutputSettings) -> dict[str, Any] | None:
    """The request's own constraint (``StructuredOutputsParams`` keywords): vLLM's ``structured_outputs``, or
    OpenAI's ``response_format``; None for free text."""
    compact = {"disable_any_whitespace": True} if settings.disable_any_whitespace else {}
    if request.structured_outputs is not None:
        return {**compact, **request.structured_outputs.engine_kwargs()}
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True, **compact}
    return {"json": response_format.json_schema.schema_ or {"type": "object"}, **compact}


def _completion_prompts(request: CompletionRequest, tokenizer: Tokenizer) -> list[EnginePrompt]:
    if request.segments is not None:
        try:
            return [segment_token_lists((s.kind, s.token_ids) for s in request.segments)]
        except ValueError as exc:
            raise APIError(str(exc), param="segments") from exc
    prompts = []
    for prompt in request.prompts:
        if isinstance(prompt, list):
            prompts.append(list(prompt))
            continue
        try:
            prompts.append(tokenizer.segment_prompt(prompt))
        except PICSyntaxError as exc:
            raise APIError(f"bad <pic> markup: {exc}", param="prompt", code="invalid_pic_tags") from exc
        except ValueError as exc:
            raise APIError(str(exc), param="prompt") from exc
    if not prompts:
        raise APIError("the prompt list is empty", param="prompt")
    return prompts


def _engine_input(request: SamplingFields, prompts: list[EnginePrompt], prompt_param: str, max_tokens: int | None,
                  max_model_len: int, tokenizer: Tokenizer, *, logprobs: int | None,
                  structured: dict[str, Any] | None, tool_parser: ToolParser | None = None,
                  echo: tuple[str, ...] | None = None) -> EngineInput:
    longest = max(_check_length(p, prompt_param, max_tokens, max_model_len) for p in prompts)
    _check_token_ids(request, tokenizer)
    options = _sampling_options(request, logprobs, structured, tool_parser)
    if echo is not None and logprobs is not None and prompt_param == "prompt" and request.prompt_logprobs is None:
        options["prompt_logprobs"] = logprobs  # the echoed prompt's own logprobs
    try:
        params = SamplingParams(max_tokens=max_tokens if max_tokens is not None else max_model_len - longest,
                                **options)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    backend = request.pic_backend if "pic_backend" in request.model_fields_set else ENGINE_DEFAULT
    token_text = TokenIdText() if request.return_tokens_as_token_ids else \
        (lambda token_id: tokenizer.decode([token_id], False))
    form = ChoiceFormat(params.stop, logprobs, tool_parser, token_text, echo=echo,
                        score_only=getattr(request, "score_only", False),
                        show_prompt_logprobs=request.prompt_logprobs is not None,
                        continuous_usage=request.continuous_usage_in_stream)
    return EngineInput(tuple(prompts), params, backend, request.prefill_peer, form, request.request_id)


def _sampling_options(request: SamplingFields, logprobs: int | None, structured: dict[str, Any] | None,
                      tool_parser: ToolParser | None) -> dict[str, Any]:
    options = dict(n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                   min_p=request.min_p, seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
                   ignore_eos=request.ignore_eos, presence_penalty=request.presence_penalty,
                   frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
                   min_tokens=request.min_tokens, logit_bias=request.token_logit_bias, logprobs=logprobs,
                   prompt_logprobs=request.prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
                   spaces_between_special_tokens=request.spaces_between_special_tokens,
                   include_stop_str_in_output=request.include_stop_str_in_output,
                   truncate_prompt_tokens=request.truncate_prompt_tokens, bad_words=request.bad_words,
                   allowed_token_ids=request.allowed_token_ids)
    if tool_parser is not None and tool_parser.keeps_special_tokens:
        options["skip_special_tokens"] = False  # its markers are special tokens
    if structured is not None:
        from nebula_engine.engine.structured_outputs import StructuredOutputsParams

        try:
            options["structured_outputs"] = StructuredOutputsParams(**structured)
        except ValueError as exc:
            param = "structured_outputs" if request.structured_outputs is not None else "response_format"
            raise APIError(str(exc), param=param) from exc
    return options


def _check_length(prompt: EnginePrompt, prompt_param: str, max_tokens: int | None, max_model_len: int) -> int:
    num_prompt = len(prompt.token_ids) if isinstance(prompt, SegmentedPrompt) else len(prompt)
    if num_prompt == 0:
        raise APIError(f"the {prompt_param} is empty: it must hold at least one token", param=prompt_param)
    if num_prompt >= max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, and the {prompt_param} "
                       f"has {num_prompt}: no room left to generate", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens, but {num_prompt + max_tokens}"
                       f" were requested ({num_prompt} in the {prompt_param}, {max_tokens} for the completion)",
                       param="max_tokens", code="context_length_exceeded")
    return num_prompt


def _check_token_ids(request: SamplingFields, tokenizer: Tokenizer) -> None:
    vocab_size = len(tokenizer.hf)
    for param, token_ids in (("logit_bias", request.token_logit_bias or {}),
                             ("allowed_token_ids", request.allowed_token_ids or ())):
        outside = sorted(t for t in token_ids if t >= vocab_size)
        if outside:
            raise APIError(f"{param} names token ids outside the vocabulary (size {vocab_size}): {outside[:8]}",
                           param=param)
