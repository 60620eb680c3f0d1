"""vLLM's offline API surface: reset_prefix_cache, use_tqdm, tokenizer= / skip_tokenizer_init= / revision=,
chat with OpenAI content parts (one flattening function shared with the HTTP server)."""

import pytest

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.chat_messages import flatten_content_parts

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


def test_reset_prefix_cache_empties_the_device_cache(llm):
    first = llm.generate(LONG_PROMPT, GREEDY)[0]
    cached = llm.generate(LONG_PROMPT, GREEDY)[0]
    assert cached.num_prefix_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    after = llm.generate(LONG_PROMPT, GREEDY)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids


def test_reset_prefix_cache_refuses_while_requests_run(llm):
    engine = llm.llm_engine
    engine.add_request("busy", llm.get_tokenizer().encode(LONG_PROMPT), GREEDY)
    try:
        assert llm.reset_prefix_cache() is False
    finally:
        engine.abort_request("busy")
    assert llm.reset_prefix_cache() is True


class CountingBar:
    """A tqdm-like class (what ``use_tqdm`` may be, as in vLLM) that records what it was told."""

    made = []

    def __init__(self, total, **kwargs):
        self.total, self.updates, self.closed = total, 0, False
        CountingBar.made.append(self)

    def update(self, n):
        self.updates += n

    def close(self):
        self.closed = True


def test_use_tqdm_counts_finished_prompts(llm, capsys):
    CountingBar.made = []
    outputs = llm.generate(["a", "b", "c"], GREEDY, use_tqdm=CountingBar)
    [bar] = CountingBar.made
    assert (bar.total, bar.updates, bar.closed) == (3, 3, True) and len(outputs) == 3
    llm.generate(["a", "b"], GREEDY)  # the default: tqdm's own bar on stderr
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    llm.generate("a", GREEDY)  # one prompt: no bar
    assert "Processed prompts" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate(["a", "b"], GREEDY, use_tqdm="yes")
    assert not llm.llm_engine.has_unfinished_requests()  # refused before the prompts were queued


def test_chat_takes_openai_content_parts(llm):
    plain = llm.chat([{"role": "user", "content": "Hello there\nHow are you?"}], GREEDY)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello there"},
                                                   {"type": "text", "text": "How are you?"}]}], GREEDY)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids and parts.outputs[0].text == plain.outputs[0].text
    pic = [{"role": "user", "content": [{"type": "text", "text": "Read <pic>a doc about owls</pic> then answer."}]}]
    assert llm.chat(pic, GREEDY)[0].outputs[0].token_ids == llm.chat(
        [{"role": "user", "content": "Read <pic>a doc about owls</pic> then answer."}], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}], "part 0: 'image_url' parts need a multimodal"),
    ([{"type": "text", "text": "hi"}, {"type": "input_audio"}], "part 1: 'input_audio'"),
    ([{"type": "video"}], "unknown content part type 'video'"),
    ([{"type": "text"}], "string 'text'"),
    (["hi"], "a content part is an object"),
    (42, "content must be a string, a list of content parts or null"),
])
def test_unusable_content_parts_are_clear_value_errors(llm, content, message):
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": content}], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_flatten_content_parts_leaves_strings_and_nulls_and_other_fields():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}],
                 "tool_call_id": "1"},
                {"role": "user", "content": "plain"}]
    assert flatten_content_parts(messages) == [messages[0], {**messages[1], "content": "a\nb"}, messages[2]]


def test_tokenizer_option_takes_the_tokenizer_from_elsewhere(qwen3_dir, tmp_path):
    import shutil

    weights_only = tmp_path / "weights"
    shutil.copytree(qwen3_dir, weights_only)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (weights_only / name).unlink(missing_ok=True)
    llm = LLM(str(weights_only), tokenizer=str(qwen3_dir), num_pages=64, page_size=8)
    reference = LLM(str(qwen3_dir), num_pages=64, page_size=8)
    assert llm.generate("Hello there", GREEDY)[0].outputs[0].text == \
        reference.generate("Hello there", GREEDY)[0].outputs[0].text


def test_skip_tokenizer_init_runs_token_ids_without_text(qwen3_dir, llm):
    bare = LLM(str(qwen3_dir), skip_tokenizer_init=True, num_pages=64, page_size=8)
    ids = llm.get_tokenizer().encode("Hello there")
    out = bare.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                  logprobs=1))[0]
    expected = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    assert out.outputs[0].token_ids == expected.token_ids and out.outputs[0].text == ""
    assert all(entry.decoded_token is None for d in out.outputs[0].logprobs for entry in d.values())
    for call in (lambda: bare.generate("text"), lambda: bare.chat([{"role": "user", "content": "x"}]),
                 bare.get_tokenizer):
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            call()
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.generate({"prompt_token_ids": ids}, SamplingParams(stop=["x"]))


def test_revision_of_a_local_path_is_an_error_not_ignored(qwen3_dir):
    with pytest.raises(ValueError, match="revision='v1'.*local path"):
        LLM(str(qwen3_dir), revision="v1", num_pages=64, page_size=8)
