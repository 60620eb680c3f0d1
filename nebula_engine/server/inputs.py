"""Request body -> what the engine runs: prompt (token ids or ``SegmentedPrompt``), ``SamplingParams``, PIC backend.

Text prompts and chat messages always go through ``<pic>`` segmentation (untagged text is one regular
segment, so the ids equal plain tokenization); token-id prompts are taken as they are. Every problem is an
``APIError`` (400) naming the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.pic.segments import PICSyntaxError, SegmentedPrompt, segment_token_lists
from nebula_engine.server.engine_client import DEFAULT_BACKEND, EnginePrompt
from nebula_engine.server.errors import APIError
from nebula_engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True)
class EngineInput:
    prompt: EnginePrompt
    params: SamplingParams
    pic_backend: object  # a backend spec, None (PIC off), or DEFAULT_BACKEND (the engine's)
    route: str | None = None  # cluster: the prefill peer that must run the combine


def completion_input(request: CompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> EngineInput:
    prompt = _completion_prompt(request, tokenizer)
    return _engine_input(request, prompt, "prompt", request.max_tokens, max_model_len)


def chat_input(request: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> EngineInput:
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    try:
        prompt = tokenizer.segment_chat(messages)
    except PICSyntaxError as exc:
        raise APIError(f"bad <pic> markup: {exc}", param="messages", code="invalid_pic_tags") from exc
    except ValueError as exc:  # no chat template, or one that mangles PIC placeholders
        raise APIError(str(exc), param="messages") from exc
    return _engine_input(request, prompt, "messages", request.max_output_tokens, max_model_len)


def _completion_prompt(request: CompletionRequest, tokenizer: Tokenizer) -> EnginePrompt:
    if request.segments is not None:
        try:
            return segment_token_lists((s.kind, s.token_ids) for s in request.segments)
        except ValueError as exc:
            raise APIError(str(exc), param="segments") from exc
    prompt = request.prompt
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    try:
        return tokenizer.segment_prompt(text)
    except PICSyntaxError as exc:
        raise APIError(f"bad <pic> markup: {exc}", param="prompt", code="invalid_pic_tags") from exc
    except ValueError as exc:
        raise APIError(str(exc), param="prompt") from exc


def _engine_input(request: SamplingFields, prompt: EnginePrompt, prompt_param: str, max_tokens: int | None,
                  max_model_len: int) -> EngineInput:
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
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else max_model_len - num_prompt,
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, seed=request.seed,
            stop=request.stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    backend = request.pic_backend if "pic_backend" in request.model_fields_set else DEFAULT_BACKEND
    return EngineInput(prompt, params, backend, request.prefill_peer)
