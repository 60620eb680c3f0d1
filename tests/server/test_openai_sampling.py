"""The sampling side of the protocol through the official ``openai`` client: ``n``, logprobs (chat and
completions, whole and streamed), penalties, ``min_p``, ``min_tokens``, ``logit_bias``, ``response_format``,
explicit nulls, a batch of prompts, ``/v1/models/{id}``, ``/tokenize`` and ``/detokenize``. Each answer is checked
against the offline API with the same settings (the engine's behaviour itself is tested in tests/engine)."""

from __future__ import annotations

import json
import math

import httpx2
import openai
import pytest

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, offline, serve_for_openai_clients

PROMPTS = ["The quick brown fox", "Once upon a time"]
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    yield from serve_for_openai_clients(LLMEngine(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS)))


def test_explicit_nulls_mean_absent(server):
    nulls = {name: None for name in (
        "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
        "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools", "tool_choice", "user",
        "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids")}
    response = httpx2.post(f"{server.url}/v1/chat/completions", timeout=60,
                           json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, **nulls})
    assert response.status_code == 200, response.text
    nulls.pop("top_logprobs"), nulls.pop("max_completion_tokens"), nulls.pop("tools"), nulls.pop("tool_choice")
    response = httpx2.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "echo": None, "suffix": None,
                                 "best_of": None, **nulls})
    assert response.status_code == 200, response.text


def test_a_model_by_id_and_an_unknown_one(client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-17")
    assert raised.value.body["code"] == "model_not_found" and "gpt-17" in raised.value.body["message"]


def test_tokenize_and_detokenize_as_vllm_has_them(server, reference_llm):
    tokenizer = reference_llm.llm_engine.tokenizer
    tokens = httpx2.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world",
                                                         "return_token_strs": True}, timeout=30).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] > 0 and "".join(tokens["token_strs"]).replace("Ġ", " ") == "Hello world"
    chat = httpx2.post(f"{server.url}/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT)[1]
    text = httpx2.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert text == {"prompt": "Hello world"}
    bad = httpx2.post(f"{server.url}/detokenize", json={"tokens": [10 ** 9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx2.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": CHAT}, timeout=30)
    assert both.status_code == 400


def test_a_batch_of_prompts_gives_a_choice_per_prompt(client, reference_llm):
    tokenizer = reference_llm.llm_engine.tokenizer
    settings = dict(max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    expected = [offline(reference_llm, p, max_tokens=5, temperature=0.0, ignore_eos=True).outputs[0].text
                for p in PROMPTS]
    for prompts in (PROMPTS, [tokenizer.encode(p) for p in PROMPTS]):  # texts, or token-id lists (vLLM's form)
        reply = client.completions.create(model=MODEL_NAME, prompt=prompts, **settings)
        assert [c.index for c in reply.choices] == [0, 1] and [c.text for c in reply.choices] == expected
        assert reply.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS, stream=True, **settings))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)] == expected


def test_n_choices_equal_the_offline_n_with_the_same_seed(client, reference_llm):
    expected = offline(reference_llm, PROMPTS[0], n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=3, seed=7, temperature=1.0,
                                      max_tokens=6, extra_body={"ignore_eos": True})
    assert [(c.index, c.text) for c in reply.choices] == [(o.index, o.text) for o in expected.outputs]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, seed=3, max_tokens=4,
                                                 stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, seed=3, max_tokens=4)
    assert ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
            for i in (0, 1)] == [c.message.content for c in whole.choices]


def test_chat_logprobs_equal_the_offline_logprobs_whole_and_streamed(client, reference_llm):
    prompt = reference_llm.llm_engine.tokenizer.apply_chat_template(CHAT)[1]
    expected = offline(reference_llm, {"prompt_token_ids": prompt}, max_tokens=5, temperature=0.0,
                       ignore_eos=True, logprobs=3).outputs[0]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token_id, position in zip(content, expected.token_ids, expected.logprobs):
        assert math.isclose(entry.logprob, position[token_id].logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy: the top one
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The second request finds the first one's prompt in the prefix cache, so its last prompt tokens attend over
    # cached pages through another kernel split: tokens equal, logprobs equal to float precision (as offline).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_completion_logprobs_in_openais_legacy_shape(client, reference_llm):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    expected = offline(reference_llm, PROMPTS[1], max_tokens=5, temperature=0.0, ignore_eos=True,
                       logprobs=2).outputs[0]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert logprobs.token_logprobs == pytest.approx([p[t].logprob for t, p in zip(expected.token_ids,
                                                                                  expected.logprobs)], abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens


@pytest.mark.parametrize("field, value", [("presence_penalty", 1.5), ("frequency_penalty", 1.5),
                                          ("repetition_penalty", 1.8), ("min_p", 0.2), ("min_tokens", 4)])
def test_each_sampling_field_reaches_the_engine(client, reference_llm, field, value):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, seed=11,
                                      extra_body={field: value} if field not in ("presence_penalty",
                                                                                 "frequency_penalty") else {},
                                      **({field: value} if field in ("presence_penalty", "frequency_penalty")
                                         else {}))
    expected = offline(reference_llm, PROMPTS[0], max_tokens=8, temperature=0.8, seed=11, **{field: value})
    assert reply.choices[0].text == expected.outputs[0].text


def test_logit_bias_forces_a_token(client, reference_llm):
    token = reference_llm.llm_engine.tokenizer.encode_plain(" blue")[0]
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=1.0, seed=1,
                                      logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == " blue" * 4


def test_response_format_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "colour", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["colour"] in ("red", "blue")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})


@pytest.mark.parametrize("fields, param", [
    (dict(temperature=5), "temperature"), (dict(n=0), "n"), (dict(top_logprobs=3), "top_logprobs"),
    (dict(logit_bias={"not-a-token": 5}), "logit_bias"), (dict(logit_bias={"7": 500}), "logit_bias"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(tool_choice={"type": "function", "function": {"name": "missing"}},
          tools=[{"type": "function", "function": {"name": "present"}}]), "tool_choice"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
])
def test_the_openai_client_sees_bad_values_as_bad_requests_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, **fields)
    assert raised.value.body["param"] == param and raised.value.body["message"]
    assert client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2).choices[0].message


def test_prompt_logprobs_in_vllms_shape(client, reference_llm):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    expected = offline(reference_llm, PROMPTS[0], max_tokens=1, prompt_logprobs=1).prompt_logprobs
    got = reply.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected)
    for position, wanted in zip(got[1:], expected[1:]):
        assert {int(k) for k in position} == set(wanted)
        assert all(math.isclose(position[str(k)]["logprob"], v.logprob, abs_tol=1e-4) for k, v in wanted.items())
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) == \
        chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="not available when streaming"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, extra_body={"prompt_logprobs": 1})
