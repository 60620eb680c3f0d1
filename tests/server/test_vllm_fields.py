"""vLLM's request fields through the real ``openai`` client: unknown fields ignored with one warning, the
sampling extras (``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
``return_tokens_as_token_ids``, ``request_id``, ``continuous_usage_stats``), chat's template options and echo,
and scoring requests (``echo`` with ``logprobs`` and ``max_tokens: 0``, as lm-evaluation-harness sends them),
whose logprobs equal the offline API's ``prompt_logprobs``."""

from __future__ import annotations

import logging

import openai
import pytest

from nebula_engine import SamplingParams
from tests.server.conftest import MODEL_NAME, offline, serve_for_openai_clients

PROMPT = "The quick brown fox jumps over the lazy dog and"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(observed_engine):
    yield from serve_for_openai_clients(observed_engine)


def test_unknown_fields_are_ignored_and_named_in_one_warning(client, reference_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="nebula_engine.server.inputs"):
        reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "frobnicate": 3,
                                                      "stream_options_typo": {"x": 1},
                                                      "response_format": {"type": "text", "colour": "red"}})
    expected = offline(reference_llm, PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert reply.choices[0].text == expected.outputs[0].text
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: frobnicate, "
                        "stream_options_typo, response_format.colour"]


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_scoring_logprobs_equal_offline_prompt_logprobs(client, reference_llm):
    tokenizer = reference_llm.get_tokenizer()
    token_ids = tokenizer.encode(PROMPT)
    [expected] = reference_llm.generate({"prompt_token_ids": token_ids},
                                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    scored = client.completions.create(model=MODEL_NAME, prompt=token_ids, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(token_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position, (token_id, value) in enumerate(zip(token_ids[1:], logprobs.token_logprobs[1:]), start=1):
        assert value == pytest.approx(expected.prompt_logprobs[position][token_id].logprob, abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(token_ids))]

    # lm-evaluation-harness' loglikelihood request: echo, max_tokens 1, logprobs 1; it reads [ctxlen:-1]
    harness = client.completions.create(model=MODEL_NAME, prompt=[token_ids], echo=True, logprobs=1, max_tokens=1,
                                        temperature=0, seed=1234)
    harness_logprobs = harness.choices[0].logprobs
    assert len(harness_logprobs.token_logprobs) == len(token_ids) + 1
    assert harness_logprobs.token_logprobs[0] is None
    assert harness_logprobs.token_logprobs[1:len(token_ids)] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)
    greedy = max(harness_logprobs.top_logprobs[-1].values())
    assert harness_logprobs.token_logprobs[-1] == pytest.approx(greedy, abs=1e-6)  # greedy: its own top entry
    assert harness.choices[0].text.startswith(choice.text)


def test_echo_of_a_text_prompt_streams_the_prompt_first(client, reference_llm):
    expected = offline(reference_llm, PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=3, stream=True,
                                            **GREEDY))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + expected.outputs[0].text
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=3, **GREEDY)
    assert whole.choices[0].text == PROMPT + expected.outputs[0].text


def test_sampling_extras_match_the_offline_api(client, reference_llm):
    tokenizer = reference_llm.get_tokenizer()
    free = offline(reference_llm, PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).outputs[0]
    banned_word = tokenizer.decode(free.token_ids[:1]).strip() or tokenizer.decode(free.token_ids[1:2]).strip()
    for extra, params in (({"bad_words": [banned_word]}, dict(bad_words=[banned_word])),
                          ({"allowed_token_ids": free.token_ids[2:5]}, dict(allowed_token_ids=free.token_ids[2:5])),
                          ({"truncate_prompt_tokens": 4}, dict(truncate_prompt_tokens=4))):
        reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, **extra})
        expected = offline(reference_llm, PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, **params)
        assert reply.choices[0].text == expected.outputs[0].text, extra
        assert expected.outputs[0].token_ids != free.token_ids, extra  # each option changed the output
    allowed = offline(reference_llm, PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True,
                      allowed_token_ids=free.token_ids[2:5]).outputs[0]
    assert set(allowed.token_ids) <= set(free.token_ids[2:5])
    truncated = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert truncated.usage.prompt_tokens == 4


def test_a_stop_string_stays_in_the_text_when_asked(client, reference_llm):
    free = offline(reference_llm, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).outputs[0].text
    stop = free[3:6]
    without = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY)
    kept = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, stop=[stop], temperature=0,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert without.choices[0].text + stop == kept.choices[0].text == free[:free.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_tokens_as_token_ids_request_id_and_continuous_usage(client):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                  "request_id": "my-trace-7"})
    assert reply.id == "cmpl-my-trace-7"
    assert all(t.startswith("token_id:") for t in reply.choices[0].logprobs.tokens)
    assert all(k.startswith("token_id:") for top in reply.choices[0].logprobs.top_logprobs for k in top)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    usages = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert usages and usages == sorted(usages) and chunks[-1].usage.completion_tokens == 4


def test_chat_template_options_and_echo(client, reference_llm):
    tokenizer = reference_llm.llm_engine.tokenizer
    partial = CHAT + [{"role": "assistant", "content": "The colour is"}]
    continued = client.chat.completions.create(
        model=MODEL_NAME, messages=partial, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    [expected] = reference_llm.chat(partial, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                    continue_final_message=True, add_generation_prompt=False)
    assert continued.choices[0].message.content == "The colour is" + expected.outputs[0].text
    rendered = tokenizer.apply_chat_template(partial, None, _options(False, True))[0]
    assert rendered.endswith("The colour is") and continued.usage.prompt_tokens == len(expected.prompt_token_ids)
    # template variables reach the template: the tiny model's ChatML template ignores this one, so the prompt is the
    # same, and the request is valid
    with_kwargs = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}})
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, **GREEDY)
    assert with_kwargs.usage.prompt_tokens == plain.usage.prompt_tokens


def _options(add_generation_prompt, continue_final_message):
    from nebula_engine.engine.tokenizer import ChatOptions

    return ChatOptions(add_generation_prompt, continue_final_message)
