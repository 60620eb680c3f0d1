"""LLM.generate / chat behaviour on a tiny Qwen3: stopping, seeds, validation, chat, detokenization."""

import pytest

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.output_processor import find_stop_string
from nebula_engine.engine.tokenizer import IncrementalDetokenizer

PROMPT = "The quick brown fox jumps over"


def greedy(max_tokens=12, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=kwargs.pop("ignore_eos", True), **kwargs)


def test_outputs_come_back_in_input_order_with_prompts(llm):
    prompts = ["a b c d e f g h i j", "hi", {"prompt_token_ids": [5, 6, 7]}]
    outputs = llm.generate(prompts, greedy(max_tokens=3))
    assert [o.prompt for o in outputs] == ["a b c d e f g h i j", "hi", None]
    assert outputs[2].prompt_token_ids == [5, 6, 7]
    assert outputs[1].prompt_token_ids == llm.get_tokenizer().encode("hi")
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert len({o.request_id for o in outputs}) == 3


def test_max_tokens_finishes_with_length(llm):
    [out] = llm.generate(PROMPT, greedy(max_tokens=5))
    completion = out.outputs[0]
    assert len(completion.token_ids) == len(completion.token_logprobs) == 5 and completion.logprobs is None
    assert completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_text_before_it(llm):
    full = llm.generate(PROMPT, greedy())[0].outputs[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    index = full.text.index(stop)
    out = llm.generate(PROMPT, greedy(stop=[stop, "never-appears-xyz"]))[0].outputs[0]
    assert out.text == full.text[:index]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_generation_and_is_kept_in_token_ids(llm):
    full = llm.generate(PROMPT, greedy())[0].outputs[0]
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)


def test_eos_stops_unless_ignored(llm, monkeypatch):
    full = llm.generate(PROMPT, greedy())[0].outputs[0]
    eos = full.token_ids[2]
    first = full.token_ids.index(eos)
    monkeypatch.setattr(llm.llm_engine.output_processor, "eos_token_ids", {eos})
    stopped = llm.generate(PROMPT, greedy(ignore_eos=False))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    tokenizer = llm.get_tokenizer()
    assert stopped.text == tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)
    ignored = llm.generate(PROMPT, greedy(ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == full.token_ids


def test_generation_stops_at_max_model_len(qwen3_dir):
    small = LLM(str(qwen3_dir), num_pages=8, page_size=4, max_model_len=10)
    [out] = small.generate({"prompt_token_ids": list(range(1, 9))}, greedy(max_tokens=16))
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len is 10"):
        small.generate({"prompt_token_ids": list(range(1, 11))}, greedy())


def test_same_seed_reproduces_and_batch_composition_does_not_matter(llm):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, seeded)[0].outputs[0].token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=99))
    batch = llm.generate(["something else entirely", PROMPT, "x"],
                         [SamplingParams(max_tokens=5, temperature=1.0), seeded, greedy(max_tokens=9)])
    assert alone == again == batch[1].outputs[0].token_ids
    assert other_seed[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("prompt, params, message", [
    ("", greedy(), "prompt is empty"),
    ({"prompt_token_ids": []}, greedy(), "prompt is empty"),
    ({"prompt_token_ids": [1, 10 ** 7]}, greedy(), "outside the vocabulary"),
    ({"prompt_token_ids": [1, -1]}, greedy(), "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 5000}, greedy(), "max_model_len"),
    ([1, 2, 3], greedy(), "a prompt is a string or a dict"),
])
def test_invalid_input_raises_before_scheduling_and_engine_still_works(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["a fine prompt", prompt], params)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.kv_cache.num_free_pages == 256
    assert len(llm.generate("still works", greedy(max_tokens=2))[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], [greedy(), greedy()])


def test_chat_applies_the_template_to_one_or_many_conversations(llm):
    conversation = [{"role": "user", "content": "Hello there"}]
    tokenizer = llm.get_tokenizer()
    expected_text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    [single] = llm.chat(conversation, greedy(max_tokens=3))
    assert single.prompt == expected_text
    assert single.prompt_token_ids == tokenizer.encode(expected_text, add_special_tokens=False)
    many = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], greedy(max_tokens=3))
    assert many[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert many[1].prompt.endswith("<|im_start|>assistant\n")


def test_incremental_detokenization_matches_full_decode_across_multibyte_tokens(llm):
    tokenizer = llm.llm_engine.tokenizer
    text = "naïve café 世界 🦜𝔘𝔫 龘 déjà vu"
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    deltas = [detokenizer.add_token(t) for t in token_ids]
    assert "".join(deltas) == detokenizer.text == text
    assert "" in deltas  # some tokens only complete a character together with the next one


def test_find_stop_string_reports_the_earliest_match_overlapping_new_text():
    assert find_stop_string("hello world", 5, ("o", "wor")) == ("wor", 6)
    assert find_stop_string("hello world", 5, ("o",)) == ("o", 7)  # not the "o" of older "hello"
    assert find_stop_string("hello world", 3, ("hello",)) is None  # fully inside older text
    assert find_stop_string("hello world", 1, ("ld",)) == ("ld", 9)
