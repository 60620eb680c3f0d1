"""Chat as agents use it, through the official ``openai`` client against a real server: content parts, tools
rendered by the chat template, ``tool`` / assistant ``tool_calls`` messages, ``<pic>`` tool results reused, and
tool calls (``auto`` parsed from the model's output, ``required`` and a named function constrained) whole and
streamed. The tiny Qwen3 carries Qwen's tool template; its random weights are held to a tool-call text by the
engine's structured outputs (a regex), so the parsing path is the real one."""

from __future__ import annotations

import json

import openai
import pytest

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, serve_for_openai_clients

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                  "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
CALL_TEXT = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
REPORT = ("Weather report for Paris: 18 degrees, light wind from the west, humidity 60 percent, "
          "no rain expected before the evening, visibility good.")


@pytest.fixture(scope="module")
def llm_engine(qwen3_tools_dir):
    return LLMEngine(EngineConfig.create(str(qwen3_tools_dir), **ENGINE_SETTINGS))


@pytest.fixture(scope="module")
def server(llm_engine):
    yield from serve_for_openai_clients(llm_engine)


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 6)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kwargs)


def agent_turns(tool_result: str) -> list[dict]:
    return [{"role": "system", "content": "You are a weather agent."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": tool_result}]


def test_content_parts_are_the_same_prompt_as_their_text(client):
    parts = chat(client, [{"role": "user", "content": [{"type": "text", "text": "Name a"},
                                                       {"type": "text", "text": "colour."}]}])
    text = chat(client, [{"role": "user", "content": "Name a\ncolour."}])
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens


def test_image_parts_are_a_bad_request_naming_the_type(client):
    with pytest.raises(openai.BadRequestError, match="'image_url' parts need a multimodal model"):
        chat(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])


def test_tools_and_tool_messages_are_rendered_by_the_chat_template(client, server, qwen3_tools_dir):
    from transformers import AutoTokenizer

    messages = agent_turns("18 degrees")
    reply = chat(client, messages, tools=[WEATHER_TOOL], tool_choice="none")
    hf = AutoTokenizer.from_pretrained(qwen3_tools_dir)
    expected = hf.apply_chat_template(messages[:2] + [
        {**messages[2], "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[3]],
        tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert "<tools>" in expected and "<tool_response>\n18 degrees" in expected and '"arguments": {"city"' in expected
    assert reply.usage.prompt_tokens == len(hf.encode(expected, add_special_tokens=False))
    assert reply.choices[0].message.tool_calls in (None, [])  # tool_choice none: nothing is parsed


def test_a_tool_result_in_pic_tags_is_reused_on_the_next_request(client, llm_engine):
    stats = llm_engine.model_runner.pic_executor.stats  # read between requests, when the engine is idle
    chat(client, agent_turns(f"<pic>{REPORT}</pic>"), tools=[WEATHER_TOOL], tool_choice="none")
    hits, misses = stats.segment_hits, stats.segment_misses
    # the agent's next turn: the same tool result, now after one more exchange (another position)
    later = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi! How can I help?"}]
    messages = agent_turns(f"<pic>{REPORT}</pic>")
    second = chat(client, messages[:1] + later + messages[1:], tools=[WEATHER_TOOL], tool_choice="none")
    assert (stats.segment_hits - hits, stats.segment_misses - misses) == (1, 0)  # taken from the PIC store
    report_tokens = len(llm_engine.tokenizer.encode_plain(REPORT))
    assert second.usage.model_extra["nebula"]["pic_cached_tokens"] >= report_tokens


def test_auto_tool_choice_parses_the_models_tool_call(client):
    reply = chat(client, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL, TIME_TOOL],
                 max_tokens=60, extra_body={"structured_outputs": {"regex": CALL_TEXT}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_auto_tool_calls_stream_as_openai_streams_them(client):
    kwargs = dict(tools=[WEATHER_TOOL], max_tokens=60, extra_body={"structured_outputs": {"regex": CALL_TEXT}})
    whole = chat(client, [{"role": "user", "content": "Weather in Paris?"}], **kwargs).choices[0]
    chunks = list(chat(client, [{"role": "user", "content": "Weather in Paris?"}], stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id and calls[0].function.arguments == ""
    assert {c.index for c in calls} == {0}
    assert "".join(c.function.arguments for c in calls) == whole.message.tool_calls[0].function.arguments
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_call_arguments_stream_as_they_are_generated(client):
    """The ``openai`` client's own stream accumulation (``chat.completions.stream``) rebuilds the whole call from
    argument pieces that arrive token by token."""
    kwargs = dict(tools=[WEATHER_TOOL], max_tokens=60, extra_body={"structured_outputs": {"regex": CALL_TEXT}})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = chat(client, messages, **kwargs).choices[0].message.tool_calls[0]
    pieces = []
    with client.chat.completions.stream(model=MODEL_NAME, messages=messages, temperature=0, **kwargs) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion().choices[0]
    [call] = final.message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)
    assert "".join(pieces) == whole.function.arguments and len(pieces) > 3  # {"city": "Paris"}: several tokens
    assert call.function.parsed_arguments is None and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert final.finish_reason == "tool_calls"


def test_a_named_tool_choice_gets_schema_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, [{"role": "user", "content": "Time?"}], tools=[WEATHER_TOOL, TIME_TOOL],
                 tool_choice=choice, max_tokens=60)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert reply.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    chunks = list(chat(client, [{"role": "user", "content": "Time?"}], tools=[WEATHER_TOOL, TIME_TOOL],
                       tool_choice=choice, max_tokens=60, stream=True))
    streamed = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    assert streamed[0].function.name == "get_time"
    assert "".join(c.function.arguments for c in streamed) == call.function.arguments


def test_required_tool_choice_always_calls_a_tool(client):
    reply = chat(client, [{"role": "user", "content": "Anything."}], tools=[WEATHER_TOOL, TIME_TOOL],
                 tool_choice="required", max_tokens=80, parallel_tool_calls=False)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)
    assert reply.choices[0].finish_reason == "tool_calls"
