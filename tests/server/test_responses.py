"""Stream rendering without a model: text deltas hold back possible stop strings; chunk shapes and usage."""

from __future__ import annotations

import json

from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.server.responses import ChatCompletionStream, CompletionStream, TextDeltas, usage


def output(text: str, num_tokens: int, finished: bool = False, finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, list(range(num_tokens)), finish_reason=finish_reason,
                                  token_logprobs=[0.0] * num_tokens)
    return RequestOutput("r", None, [1, 2, 3, 4], [completion], finished=finished, num_cached_tokens=3,
                         num_prefix_cached_tokens=2, num_pic_cached_tokens=1, num_recomputed_tokens=1)


def payload(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):])


def test_text_that_a_stop_string_could_still_remove_is_held_back():
    deltas = TextDeltas(stop=("wor", "x"))
    # the engine's cumulative text; at the end it found "wor" and cut the text before it
    sent = [deltas.next(output("Hel", 1)), deltas.next(output("Hello wo", 2)),
            deltas.next(output("Hello ", 3, finished=True, finish_reason="stop"))]
    assert sent == ["H", "ello ", ""]
    assert "".join(sent) == "Hello "


def test_without_stop_strings_every_character_goes_out_at_once():
    deltas = TextDeltas(stop=())
    assert [deltas.next(output("ab", 1)), deltas.next(output("abcd", 2, finished=True))] == ["ab", "cd"]


def test_usage_splits_cached_tokens_by_kind():
    body = usage(output("hi", 2, finished=True)).model_dump()
    assert body == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                    "prompt_tokens_details": {"cached_tokens": 3},
                    "nebula": {"prefix_cached_tokens": 2, "pic_cached_tokens": 1, "recomputed_tokens": 1}}


def test_chat_stream_opens_with_the_role_and_ends_with_usage_then_done():
    stream = ChatCompletionStream("chatcmpl-1", "m", stop=(), include_usage=True)
    # the repeated output brings no new text, so it sends no chunk
    events = stream.opening() + stream.events(output("Hi", 1)) + stream.events(output("Hi", 1))
    final = output("Hi!", 2, finished=True, finish_reason="length")
    events += stream.events(final) + stream.closing(final)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [payload(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [{"role": "assistant", "content": ""},
                                                               {"content": "Hi"}, {"content": "!"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-1"}


def test_completion_stream_without_usage_has_no_usage_field():
    stream = CompletionStream("cmpl-1", "m", stop=(), include_usage=False)
    final = output("ok", 1, finished=True, finish_reason="stop")
    events = stream.opening() + stream.events(final) + stream.closing(final)
    assert [payload(e) for e in events[:-1]] == [{"id": "cmpl-1", "object": "text_completion",
                                                  "created": payload(events[0])["created"], "model": "m",
                                                  "choices": [{"index": 0, "text": "ok", "logprobs": None,
                                                               "finish_reason": "stop"}]}]
    assert events[-1] == "data: [DONE]\n\n"
