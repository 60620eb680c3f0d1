"""Stream rendering without a model: text deltas hold back possible stop strings; chunk shapes and usage."""

from __future__ import annotations

import json

from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.server.responses import (ChatCompletionStream, ChoiceFormat, CompletionStream, TextDeltas,
                                            chat_response, completion_response, usage)
from nebula_engine.server.tool_parsers import HermesToolParser


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
    sent = [deltas.next("Hel", False), deltas.next("Hello wo", False), deltas.next("Hello ", True)]
    assert sent == ["H", "ello ", ""]
    assert "".join(sent) == "Hello "


def test_without_stop_strings_every_character_goes_out_at_once():
    deltas = TextDeltas(stop=())
    assert [deltas.next("ab", False), deltas.next("abcd", True)] == ["ab", "cd"]


def test_usage_splits_cached_tokens_by_kind():
    # 2 prefix hits, 1 PIC hit that the backend recomputed: only the prefix hits were used as they were
    body = usage(output("hi", 2, finished=True)).model_dump()
    assert body == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                    "prompt_tokens_details": {"cached_tokens": 2},
                    "nebula": {"prefix_cached_tokens": 2, "pic_cached_tokens": 1, "recomputed_tokens": 1}}


def test_a_cold_pic_request_has_no_cached_tokens_and_a_plain_one_no_pic_fields():
    completion = CompletionOutput(0, "hi", [7], finish_reason="length")
    cold_pic = RequestOutput("r", None, [1, 2, 3, 4], [completion], finished=True, num_cached_tokens=0,
                             num_pic_cached_tokens=3, num_recomputed_tokens=1)  # segments prefilled for it
    assert usage(cold_pic).prompt_tokens_details.cached_tokens == 0
    assert usage(cold_pic).model_dump()["nebula"] == {"prefix_cached_tokens": 0, "pic_cached_tokens": 3,
                                                      "recomputed_tokens": 1}
    plain = RequestOutput("r", None, [1, 2, 3, 4], [completion], finished=True, num_cached_tokens=2,
                          num_prefix_cached_tokens=2)
    assert usage(plain).model_dump()["nebula"] == {"prefix_cached_tokens": 2}
    assert usage(plain).prompt_tokens_details.cached_tokens == 2


def test_chat_stream_opens_with_the_role_and_ends_with_usage_then_done():
    stream = ChatCompletionStream("chatcmpl-1", "m", ChoiceFormat(), include_usage=True)
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
    stream = CompletionStream("cmpl-1", "m", ChoiceFormat(), include_usage=False)
    final = output("ok", 1, finished=True, finish_reason="stop")
    events = stream.opening() + stream.events(final) + stream.closing(final)
    assert [payload(e) for e in events[:-1]] == [{"id": "cmpl-1", "object": "text_completion",
                                                  "created": payload(events[0])["created"], "model": "m",
                                                  "choices": [{"index": 0, "text": "ok", "logprobs": None,
                                                               "finish_reason": "stop", "stop_reason": None}]}]
    assert events[-1] == "data: [DONE]\n\n"


def completion(index: int, text: str, num_tokens: int, finish_reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(index, text, list(range(num_tokens)), logprobs=None, finish_reason=finish_reason)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_chat_stream_sends_content_then_each_call_name_first_then_its_arguments():
    stream = ChatCompletionStream("chatcmpl-1", "m", ChoiceFormat(tool_parser=HermesToolParser()),
                                  include_usage=False)
    texts = ["Let me", "Let me check. <tool", f"Let me check. {CALL[:30]}", f"Let me check. {CALL}"]
    events = stream.opening()
    for number, text in enumerate(texts):
        last = number == len(texts) - 1
        events += stream.events(RequestOutput("r", None, [1], [completion(0, text, number + 1,
                                                                          "stop" if last else None)],
                                              finished=last))
    deltas = [payload(e)["choices"][0] for e in events]
    assert [d["delta"] for d in deltas[:3]] == [{"role": "assistant", "content": ""}, {"content": "Let me"},
                                                {"content": " check. "}]  # "<tool" held back, then not content
    opening, arguments = deltas[3]["delta"]["tool_calls"][0], deltas[4]["delta"]["tool_calls"][0]
    assert opening["index"] == 0 and opening["type"] == "function" and opening["id"].startswith("chatcmpl-tool-")
    assert opening["function"] == {"name": "get_weather", "arguments": ""}
    assert arguments == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert deltas[-1]["finish_reason"] == "tool_calls" and [d["finish_reason"] for d in deltas[:-1]] == [None] * 5


def test_a_whole_chat_response_splits_content_and_tool_calls():
    final = RequestOutput("r", None, [1, 2], [completion(0, "Checking.\n" + CALL, 9, "stop"),
                                              completion(1, "It is sunny.", 4, "stop")], finished=True)
    body = chat_response("chatcmpl-1", "m", final, ChoiceFormat(tool_parser=HermesToolParser())).model_dump()
    called, plain = body["choices"]
    assert called["message"]["content"] == "Checking.\n" and called["finish_reason"] == "tool_calls"
    assert [c["function"] for c in called["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny.", "tool_calls": []}
    assert plain["finish_reason"] == "stop" and plain["index"] == 1
    assert body["usage"]["completion_tokens"] == 13


def test_a_batch_with_n_numbers_choices_prompt_major():
    finals = [RequestOutput(f"r{p}", None, [1], [completion(i, f"p{p}c{i}", 1, "length") for i in range(2)],
                            finished=True) for p in range(2)]
    body = completion_response("cmpl-1", "m", finals, ChoiceFormat()).model_dump()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "p0c0"), (1, "p0c1"), (2, "p1c0"),
                                                                  (3, "p1c1")]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 4
