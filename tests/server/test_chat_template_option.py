"""A chat template given at start-up (vLLM's ``--chat-template``, ``LLM(chat_template=...)``) on a checkpoint whose
own template renders no tools: the tool-call format is recognised from it, ``tool_choice: auto`` returns parsed
calls, and a call cut by ``max_tokens`` ends with ``finish_reason: length`` without leaking as content. Offline,
``LLM.chat`` takes ``tools``, ``chat_template``, ``chat_template_kwargs`` and ``continue_final_message``."""

from __future__ import annotations

import json

import pytest

from nebula_engine import LLM, SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.tokenizer import load_chat_template
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, openai_client, serve_for_openai_clients
from tests.server.tool_template import QWEN_TOOL_TEMPLATE

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                     "enum": ["Paris", "Rome"]}},
                                          "required": ["city"], "additionalProperties": False}}}
CALL_TEXT = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llm_engine(qwen3_dir):
    return LLMEngine(EngineConfig.create(str(qwen3_dir), chat_template=QWEN_TOOL_TEMPLATE, **ENGINE_SETTINGS))


@pytest.fixture(scope="module")
def client(llm_engine):
    for server in serve_for_openai_clients(llm_engine):
        yield openai_client(server)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER_TOOL], temperature=0,
                                          **kwargs)


def test_auto_tool_choice_works_with_the_template_given_at_start_up(client):
    reply = chat(client, max_tokens=60, extra_body={"structured_outputs": {"regex": CALL_TEXT}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_an_auto_call_cut_by_max_tokens_ends_with_length_and_no_content(client):
    kwargs = dict(max_tokens=8, extra_body={"structured_outputs": {"regex": CALL_TEXT}})
    choice = chat(client, **kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and not choice.message.tool_calls
    chunks = list(chat(client, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "" and not any(d.tool_calls for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_named_call_cut_by_max_tokens_ends_with_length_and_no_content(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tool_choice=named, max_tokens=3).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and not choice.message.tool_calls
    chunks = list(chat(client, tool_choice=named, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_offline_chat_takes_tools_a_template_and_its_variables(qwen3_dir, tmp_path):
    from transformers import AutoTokenizer

    template_file = tmp_path / "tools.jinja"
    template_file.write_text(QWEN_TOOL_TEMPLATE)
    llm = LLM(str(qwen3_dir), chat_template=str(template_file), **ENGINE_SETTINGS)
    hf = AutoTokenizer.from_pretrained(qwen3_dir)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    [with_tools] = llm.chat(ASK, params, tools=[WEATHER_TOOL])
    expected = hf.apply_chat_template(ASK, tools=[WEATHER_TOOL], chat_template=QWEN_TOOL_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert "<tools>" in expected
    assert with_tools.prompt_token_ids == hf.encode(expected, add_special_tokens=False)
    # a per-call template and its variables (this one prints one)
    shouting = "{{ greeting }}{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    [custom] = llm.chat(ASK, params, chat_template=shouting, chat_template_kwargs={"greeting": "Hi! "})
    assert custom.prompt_token_ids == hf.encode("Hi! WEATHER IN PARIS?", add_special_tokens=False)
    partial = ASK + [{"role": "assistant", "content": "It is"}]
    [continued] = llm.chat(partial, params, continue_final_message=True, add_generation_prompt=False)
    assert hf.decode(continued.prompt_token_ids).endswith("It is")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(partial, params, continue_final_message=True)


def test_chat_template_values_are_read_as_vllm_reads_them(tmp_path):
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # escapes decoded
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'x' }}")
    assert load_chat_template(str(path)) == "{{ 'x' }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")
