"""``/v1/responses`` through the real ``openai`` client's ``client.responses``: the same reply as the chat route
for the same conversation, streamed with the Responses events, ``previous_response_id`` from the store (and a
clear 404 once evicted), function tools, and ``function_call_output`` items."""

from __future__ import annotations

import json

import openai
import pytest

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, openai_client, serve_for_openai_clients
from tests.server.tool_template import QWEN_TOOL_TEMPLATE

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(qwen3_dir):
    engine = LLMEngine(EngineConfig.create(str(qwen3_dir), chat_template=QWEN_TOOL_TEMPLATE, **ENGINE_SETTINGS))
    for server in serve_for_openai_clients(engine):
        yield openai_client(server)


def test_a_response_equals_the_chat_reply_to_the_same_conversation(client):
    response = client.responses.create(model=MODEL_NAME, instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_a_stream_sends_the_responses_event_sequence(client):
    whole = client.responses.create(model=MODEL_NAME, input="Count to three.", max_output_tokens=5, temperature=0)
    events = list(client.responses.create(model=MODEL_NAME, input="Count to three.", max_output_tokens=5,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_continues_a_stored_conversation(client):
    first = client.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=3, temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).id == first.id
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        client.responses.create(model=MODEL_NAME, input="Again", previous_response_id=unstored.id)


def test_function_tools_and_their_outputs(client):
    forced = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=40, temperature=0)
    [call] = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow_up = client.responses.create(model=MODEL_NAME, tools=[WEATHER], tool_choice="none", max_output_tokens=3,
                                        temperature=0, previous_response_id=forced.id, input=[
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 degrees"}])
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=3, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}])
    assert follow_up.output_text == chat.choices[0].message.content
    assert follow_up.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_function_call_sends_its_arguments_as_they_are_generated(client):
    kwargs = dict(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=40, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    [whole] = [item for item in client.responses.create(**kwargs).output if item.type == "function_call"]
    events = list(client.responses.create(stream=True, **kwargs))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [(a.name, a.arguments, a.status) for a in added] == [("get_weather", "", "in_progress")]
    assert "".join(pieces) == done == whole.arguments and len(pieces) > 3
    [final] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert final.arguments == whole.arguments and final.call_id == added[0].call_id


def test_the_agents_sdk_include_list_is_a_known_field(client, caplog):
    """The OpenAI Agents SDK sends ``include`` on every request (empty unless it wants extra output parts)."""
    response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, include=[],
                                       tools=[WEATHER], tool_choice="none")
    assert response.status in ("completed", "incomplete")
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]
    with pytest.raises(openai.BadRequestError, match="message.output_text.logprobs"):
        client.responses.create(model=MODEL_NAME, input="Hi", include=["message.output_text.logprobs"])


def test_bad_responses_requests_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=0)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model=MODEL_NAME, input=[{"type": "image_generation_call"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-17", input="Hi")


def _responses_count(client, status: str) -> float:
    import urllib.request

    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    wanted = f'nebula_requests_total{{endpoint="responses",status="{status}"}} '
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return next((float(line.split()[-1]) for line in lines if line.startswith(wanted)), 0.0)


def test_responses_are_counted_in_the_request_metrics(client):
    ok, invalid = _responses_count(client, "ok"), _responses_count(client, "invalid")
    client.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=2, temperature=0)
    list(client.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=2, temperature=0, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi.", max_output_tokens=2)
    assert _responses_count(client, "ok") - ok == 2
    assert _responses_count(client, "invalid") - invalid == 1
