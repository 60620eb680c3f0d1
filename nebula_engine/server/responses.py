"""``RequestOutput`` -> OpenAI response bodies and server-sent-event chunks.

Engine outputs are cumulative; streams send text deltas. While a request may still stop on a stop string,
the last ``len(longest stop) - 1`` characters are held back: the engine truncates the text before a stop
string once it completes, so sending them early could emit text the final answer does not contain.
"""

from __future__ import annotations

import json
import time
from typing import Any

from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.server.protocol import (ChatChoice, ChatCompletionResponse, ChatMessageOut, CompletionChoice,
                                           CompletionResponse, NebulaUsage, PromptTokensDetails, Usage)

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(output: RequestOutput) -> Usage:
    num_prompt, num_completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
                 nebula=NebulaUsage(prefix_cached_tokens=output.num_prefix_cached_tokens,
                                    pic_cached_tokens=output.num_pic_cached_tokens,
                                    recomputed_tokens=output.num_recomputed_tokens))


def completion_response(response_id: str, model: str, output: RequestOutput) -> CompletionResponse:
    completion = output.outputs[0]
    return CompletionResponse(id=response_id, model=model, usage=usage(output),
                              choices=[CompletionChoice(text=completion.text, finish_reason=completion.finish_reason)])


def chat_response(response_id: str, model: str, output: RequestOutput) -> ChatCompletionResponse:
    completion = output.outputs[0]
    return ChatCompletionResponse(id=response_id, model=model, usage=usage(output),
                                  choices=[ChatChoice(message=ChatMessageOut(content=completion.text),
                                                      finish_reason=completion.finish_reason)])


class TextDeltas:
    """Cumulative text -> the part not sent yet, holding back what a stop string could still remove."""

    def __init__(self, stop: tuple[str, ...]):
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._sent = 0

    def next(self, output: RequestOutput) -> str:
        text = output.outputs[0].text
        end = len(text) if output.finished else max(self._sent, len(text) - self._holdback)
        delta, self._sent = text[self._sent:end], end
        return delta


class CompletionStream:
    """SSE events of a ``/v1/completions`` stream; ``include_usage``: OpenAI's ``stream_options``."""

    object = "text_completion"

    def __init__(self, response_id: str, model: str, stop: tuple[str, ...], include_usage: bool):
        self._id, self._model, self._include_usage = response_id, model, include_usage
        self._created = int(time.time())
        self._deltas = TextDeltas(stop)

    def opening(self) -> list[str]:
        return []

    def events(self, output: RequestOutput) -> list[str]:
        delta = self._deltas.next(output)
        finish_reason = output.outputs[0].finish_reason if output.finished else None
        if not delta and finish_reason is None:
            return []
        return [self._event([self._choice(delta, finish_reason)])]

    def closing(self, final: RequestOutput) -> list[str]:
        """After the last output: the usage chunk (if asked for) and ``[DONE]``."""
        events = [self._event([], usage(final).model_dump())] if self._include_usage else []
        return events + [DONE_EVENT]

    def _choice(self, delta: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}

    def _event(self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> str:
        chunk = {"id": self._id, "object": self.object, "created": self._created, "model": self._model,
                 "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage_body  # null on every chunk but the last, as OpenAI sends it
        return sse_event(chunk)


class ChatCompletionStream(CompletionStream):
    """SSE events of a ``/v1/chat/completions`` stream: a role chunk, content deltas, a finish chunk."""

    object = "chat.completion.chunk"

    def opening(self) -> list[str]:
        return [self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def _choice(self, delta: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": None,
                "finish_reason": finish_reason}
