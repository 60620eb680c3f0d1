"""``RequestOutput``s -> OpenAI response bodies and server-sent-event chunks.

A request's choices are every completion of every prompt: choice ``prompt_index * n + output.index``, as vLLM
numbers them. Engine outputs are cumulative; streams send deltas. While a completion may still stop on a stop
string, the last ``len(longest stop) - 1`` characters are held back: the engine truncates the text before a stop
string once it completes, so sending them early could emit text the final answer does not contain. With a tool
parser, chat content is split into content and ``tool_calls`` (``tool_parsers``), streamed as OpenAI streams
them: per call a chunk with its ``index``, ``id``, ``type`` and name (empty arguments), then chunks with pieces of
its arguments as they are generated (``tool_streaming``). An output
cut by ``max_tokens`` inside tool-call markup ends with ``finish_reason: length``: the unfinished call is dropped,
never sent as content.

``echo`` (completions) puts each prompt's text before its choices' text and its tokens' logprobs (the first
``null``: nothing predicts it) before theirs; with ``max_tokens: 0`` (``score_only``) the choice is the prompt
alone: the one token the engine sampled to get there is not reported.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.server.logprobs import (TokenText, chat_logprobs, completion_logprobs, echo_logprobs,
                                           prompt_logprobs)
from nebula_engine.server.protocol import (ChatChoice, ChatCompletionResponse, ChatLogprobs, ChatMessageOut,
                                           CompletionChoice, CompletionResponse, NebulaUsage, PromptTokensDetails,
                                           ToolCallOut, Usage)
from nebula_engine.server.tool_parsers import ToolParser
from nebula_engine.server.tool_streaming import CallDelta, ToolCallDeltas

DONE_EVENT = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ChoiceFormat:
    """How a request's completions become choices."""

    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and the k most likely
    tool_parser: ToolParser | None = None
    token_text: TokenText = str  # a token id -> its text (for logprobs)
    echo: tuple[str, ...] | None = None  # completions' echo: each prompt's text; chat's: the one reply prefix
    score_only: bool = False  # echo with max_tokens 0: report the prompt, not the token sampled after it
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field (asked for), besides echo's logprobs
    continuous_usage: bool = False  # stream usage on every chunk (vLLM's continuous_usage_stats)


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def cached_tokens(output: RequestOutput) -> int:
    """Prompt tokens whose KV existed before the request and was used as it was: prefix-cache hits, and PIC hits
    less the tokens the backend recomputed. Recomputed tokens are not split between hit and freshly prefilled
    segments, so a prompt that mixes both gets a lower bound."""
    pic_hits = output.num_cached_tokens - output.num_prefix_cached_tokens
    return output.num_prefix_cached_tokens + max(0, pic_hits - output.num_recomputed_tokens)


def usage(outputs: RequestOutput | Sequence[RequestOutput]) -> Usage:
    """Totals over every prompt of the request and every completion of each; ``nebula`` names the PIC split only
    for requests where PIC ran."""
    outputs = [outputs] if isinstance(outputs, RequestOutput) else outputs
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    pic_ran = any(o.num_pic_cached_tokens for o in outputs)
    split = NebulaUsage(prefix_cached_tokens=sum(o.num_prefix_cached_tokens for o in outputs))
    if pic_ran:
        split = NebulaUsage(prefix_cached_tokens=split.prefix_cached_tokens,
                            pic_cached_tokens=sum(o.num_pic_cached_tokens for o in outputs),
                            recomputed_tokens=sum(o.num_recomputed_tokens for o in outputs))
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached_tokens(o) for o in outputs)),
                 nebula=split)


def scored(output: RequestOutput, form: ChoiceFormat) -> RequestOutput:
    """``output`` as the client sees it: with ``score_only``, its completions without the sampled token."""
    if not form.score_only:
        return output
    completions = [replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                           token_logprobs=[], finish_reason="length" if output.finished else None, stop_reason=None)
                   for c in output.outputs]
    return replace(output, outputs=completions)


def _completion_logprobs(form: ChoiceFormat, output: RequestOutput, completion: CompletionOutput,
                         echoed: bool):
    """Completions' logprobs of ``completion``: the prompt's first when ``echoed``, then its generated tokens."""
    generated = completion_logprobs(completion.token_ids, completion.logprobs, form.top_logprobs, form.token_text, 0)
    if not echoed:
        return generated
    body = echo_logprobs(output.prompt_token_ids, output.prompt_logprobs, form.top_logprobs, form.token_text)
    offset = sum(len(t) for t in body.tokens)
    body.tokens += generated.tokens
    body.token_logprobs += generated.token_logprobs
    body.top_logprobs += generated.top_logprobs
    body.text_offset += [offset + o for o in generated.text_offset]
    return body


def choice_index(prompt_index: int, n: int, completion: CompletionOutput) -> int:
    return prompt_index * n + completion.index


def completion_response(response_id: str, model: str, finals: Sequence[RequestOutput],
                        form: ChoiceFormat) -> CompletionResponse:
    choices = []
    finals = [scored(final, form) for final in finals]
    for prompt_index, final in enumerate(finals):
        echo = form.echo[prompt_index] if form.echo is not None else ""
        for completion in final.outputs:
            logprobs = None if form.top_logprobs is None else _completion_logprobs(
                form, final, completion, form.echo is not None)
            shown = prompt_logprobs(final.prompt_logprobs) if form.show_prompt_logprobs else None
            choices.append(CompletionChoice(index=choice_index(prompt_index, len(final.outputs), completion),
                                            text=echo + completion.text, logprobs=logprobs,
                                            finish_reason=completion.finish_reason,
                                            stop_reason=completion.stop_reason, prompt_logprobs=shown))
    return CompletionResponse(id=response_id, model=model, usage=usage(finals), choices=choices)


def chat_response(response_id: str, model: str, final: RequestOutput, form: ChoiceFormat) -> ChatCompletionResponse:
    choices = []
    for completion in final.outputs:
        content, calls = completion.text, ()
        if form.tool_parser is not None:
            parsed = form.tool_parser.parse(completion.text, truncated=completion.finish_reason == "length")
            content, calls = parsed.content, parsed.calls
        if form.echo:
            content = form.echo[0] + (content or "")
        logprobs = None if form.top_logprobs is None else ChatLogprobs(content=chat_logprobs(
            completion.token_ids, completion.logprobs, form.top_logprobs, form.token_text))
        message = ChatMessageOut(content=content, tool_calls=[
            ToolCallOut(id=form.tool_parser.new_call_id(), function={"name": c.name, "arguments": c.arguments})
            for c in calls])
        choices.append(ChatChoice(index=completion.index, message=message, logprobs=logprobs,
                                  finish_reason=_finish_reason(completion.finish_reason, form, bool(calls)),
                                  stop_reason=completion.stop_reason))
    return ChatCompletionResponse(id=response_id, model=model, usage=usage(final), choices=choices,
                                  prompt_logprobs=prompt_logprobs(final.prompt_logprobs))



def _finish_reason(finish_reason: str | None, form: ChoiceFormat, called: bool) -> str | None:
    """``tool_calls`` when a model that stopped by itself called tools (not for a named ``tool_choice``, which
    OpenAI reports as ``stop``)."""
    if called and finish_reason == "stop" and form.tool_parser is not None and form.tool_parser.name != "named":
        return "tool_calls"
    return finish_reason


class TextDeltas:
    """Cumulative text -> the part safe to send, holding back what a stop string could still remove."""

    def __init__(self, stop: tuple[str, ...]):
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._sent = 0

    def visible(self, text: str, finished: bool) -> str:
        """The cumulative text that may go out now."""
        self._sent = len(text) if finished else max(self._sent, len(text) - self._holdback)
        return text[:self._sent]

    def next(self, text: str, finished: bool) -> str:
        before = self._sent
        return self.visible(text, finished)[before:]


@dataclass
class _ChoiceState:
    text: TextDeltas
    tools: ToolCallDeltas | None
    num_tokens_sent: int = 0
    text_offset: int = 0  # completions' logprobs: characters of the tokens sent so far
    called: bool = False
    done: bool = False
    echoed: bool = False  # completions' echo: the prompt went out (in this choice's first chunk)


class CompletionStream:
    """SSE events of a ``/v1/completions`` stream; ``include_usage``: OpenAI's ``stream_options``."""

    object = "text_completion"

    def __init__(self, response_id: str, model: str, form: ChoiceFormat, include_usage: bool, n: int = 1,
                 num_prompts: int = 1):
        self._id, self._model, self._form, self._include_usage = response_id, model, form, include_usage
        self._n, self._num_prompts = n, num_prompts
        self._created = int(time.time())
        self._choices: dict[int, _ChoiceState] = {}
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> its newest output (continuous usage)

    def opening(self) -> list[str]:
        return []

    def events(self, output: RequestOutput, prompt_index: int = 0) -> list[str]:
        events = []
        output = scored(output, self._form)
        self._latest[prompt_index] = output
        self._prompt = output  # the output whose choices are being rendered (echo reads its prompt)
        self._prompt_index = prompt_index
        for completion in output.outputs:
            index = choice_index(prompt_index, self._n, completion)
            state = self._choices.setdefault(index, self._new_state())
            if not state.done:
                events += self._choice_events(index, state, completion)
        return events

    def closing(self, finals: RequestOutput | Sequence[RequestOutput]) -> list[str]:
        """After the last output: the usage chunk (if asked for) and ``[DONE]``."""
        if isinstance(finals, RequestOutput):
            finals = [finals]
        finals = [scored(final, self._form) for final in finals]
        events = [self._event([], usage(finals).model_dump(), final=True)] if self._include_usage else []
        return events + [DONE_EVENT]

    def _new_state(self) -> _ChoiceState:
        parser = self._form.tool_parser
        return _ChoiceState(TextDeltas(self._form.stop), None if parser is None else ToolCallDeltas(parser))

    def _choice_events(self, index: int, state: _ChoiceState, completion: CompletionOutput) -> list[str]:
        finished = completion.finish_reason is not None
        delta = state.text.next(completion.text, finished)
        logprobs = self._new_logprobs(state, completion)
        if self._form.echo is not None and not state.echoed:
            state.echoed = True
            delta = self._form.echo[self._prompt_index] + delta
            logprobs = self._with_echoed_logprobs(state, logprobs)
        state.done = finished
        if not delta and not finished and logprobs is None:
            return []
        return [self._event([{"index": index, "text": delta, "logprobs": logprobs,
                              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}])]

    def _new_logprobs(self, state: _ChoiceState, completion: CompletionOutput) -> Any:
        """Logprobs of the tokens generated since the last event (None when not asked for or none new)."""
        start, end = state.num_tokens_sent, len(completion.token_ids)
        if self._form.top_logprobs is None or end == start:
            return None
        state.num_tokens_sent = end
        return self._logprobs(state, completion.token_ids[start:end], completion.logprobs[start:end])

    def _logprobs(self, state: _ChoiceState, token_ids: Sequence[int], logprobs: Sequence[Any]) -> Any:
        body = completion_logprobs(token_ids, logprobs, self._form.top_logprobs, self._form.token_text,
                                   state.text_offset)
        state.text_offset += sum(len(t) for t in body.tokens)
        return body.model_dump()

    def _with_echoed_logprobs(self, state: _ChoiceState, generated: dict[str, Any] | None) -> dict[str, Any] | None:
        """The prompt's logprobs, then ``generated`` (already offset past them), for a choice's first chunk."""
        if self._form.top_logprobs is None:
            return generated
        prompt = echo_logprobs(self._prompt.prompt_token_ids, self._prompt.prompt_logprobs, self._form.top_logprobs,
                               self._form.token_text).model_dump()
        shift = sum(len(t) for t in prompt["tokens"])
        state.text_offset += shift
        if generated is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                prompt[key] += generated[key]
            prompt["text_offset"] += [shift + o for o in generated["text_offset"]]
        return prompt

    def _event(self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None,
               final: bool = False) -> str:
        chunk = {"id": self._id, "object": self.object, "created": self._created, "model": self._model,
                 "choices": choices}
        if self._include_usage:
            if self._form.continuous_usage and not final and self._latest:
                usage_body = usage(list(self._latest.values())).model_dump()
            chunk["usage"] = usage_body  # null on every chunk but the last, as OpenAI sends it
        return sse_event(chunk)


class ChatCompletionStream(CompletionStream):
    """SSE events of a ``/v1/chat/completions`` stream: a role chunk per choice, content (and tool call) deltas,
    a finish chunk."""

    object = "chat.completion.chunk"

    def opening(self) -> list[str]:
        events = [self._event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]) for index in range(self._n * self._num_prompts)]
        if self._form.echo and self._form.echo[0]:
            events += [self._choice(index, {"content": self._form.echo[0]})
                       for index in range(self._n * self._num_prompts)]
        return events

    def _choice_events(self, index: int, state: _ChoiceState, completion: CompletionOutput) -> list[str]:
        finished = completion.finish_reason is not None
        calls: list[CallDelta] = []
        if state.tools is None:
            content = state.text.next(completion.text, finished)
        else:
            content, calls = state.tools.next(state.text.visible(completion.text, finished), finished,
                                              truncated=completion.finish_reason == "length")
        logprobs = self._new_logprobs(state, completion)
        state.called = state.called or bool(calls)
        state.done = finished
        reason = _finish_reason(completion.finish_reason, self._form, state.called) if finished else None
        events = []
        if content or logprobs is not None or (finished and not calls):
            events.append(self._choice(index, {"content": content} if content else {}, logprobs,
                                       None if calls else reason, completion.stop_reason))
        for call in calls:
            events += self._call_events(index, call)
        if finished and calls:
            events.append(self._choice(index, {}, None, reason, completion.stop_reason))
        return events

    def _call_events(self, index: int, call: CallDelta) -> list[str]:
        events = []
        if call.name is not None:
            events.append(self._choice(index, {"tool_calls": [{
                "index": call.number, "id": self._form.tool_parser.new_call_id(), "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}))
        if call.arguments:
            events.append(self._choice(index, {"tool_calls": [{"index": call.number,
                                                               "function": {"arguments": call.arguments}}]}))
        return events

    def _choice(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None,
                stop_reason: int | str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._event([choice])

    def _logprobs(self, state: _ChoiceState, token_ids: Sequence[int], logprobs: Sequence[Any]) -> Any:
        entries = chat_logprobs(token_ids, logprobs, self._form.top_logprobs, self._form.token_text)
        return {"content": [e.model_dump() for e in entries]}
