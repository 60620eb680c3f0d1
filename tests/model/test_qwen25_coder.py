"""The real default model, Qwen2.5-Coder-0.5B-Instruct (GGUF architecture ``qwen2``, a Q5_0 / Q8_0 / Q4_K / Q6_K
mix), against transformers' own GGUF loader on the same file: tokenizer and chat template (tools included),
last-position logits of three chats, and 64 greedy tokens of each."""

from __future__ import annotations

import pytest
import torch
import transformers

from nebula_engine import LLM, SamplingParams
from nebula_engine.kernels.attention import AttentionContext

pytestmark = pytest.mark.xdist_group("real-model")  # one worker holds the 2 GB models, not both

CHATS = (
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain what a KV cache is."}],
)
TEXTS = ("Hello world", "  leading spaces,\ttabs\n\nand blank lines", "Ünïcödé 日本語 🙂 café",
         "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x[-1]  # 3", "1234567 + 89 = ?",
         "<tool_call>\n{\"name\": \"f\"}\n</tool_call>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen05(qwen05_path):
    pytest.importorskip("gguf", reason="the model is a GGUF file: pip install 'nebula-engine[gguf]'")
    return LLM(str(qwen05_path), num_pages=128)


@pytest.fixture(scope="module")
def hf_tokenizer(qwen05_path):
    return transformers.AutoTokenizer.from_pretrained(qwen05_path.parent, gguf_file=qwen05_path.name)


@pytest.fixture(scope="module")
def hf_model(qwen05_path):
    return transformers.AutoModelForCausalLM.from_pretrained(qwen05_path.parent, gguf_file=qwen05_path.name,
                                                             dtype=torch.float32).eval()


def test_config_is_qwen2_with_qkv_biases_and_its_own_output_head(qwen05):
    config = qwen05.llm_engine.model_config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (14, 2, 151936)
    assert config.rope.theta == 1e6 and config.rms_norm_eps == pytest.approx(1e-6) and config.attention_bias
    assert not config.tie_word_embeddings  # the file stores output.weight (Q8_0) beside token_embd


def test_tokenizer_and_chat_template_with_tools_match_transformers(qwen05, hf_tokenizer):
    tokenizer = qwen05.llm_engine.tokenizer
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [hf_tokenizer.convert_tokens_to_ids("<|im_start|>")]
    for chat in CHATS:
        text, ids = tokenizer.apply_chat_template(chat, tools=[WEATHER_TOOL])
        assert text == hf_tokenizer.apply_chat_template(chat, tools=[WEATHER_TOOL], tokenize=False,
                                                        add_generation_prompt=True)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        assert "<tool_call>" in text and '"get_weather"' in text  # Hermes-style tool rendering
    assert tokenizer.prompt_prefix_ids == []
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id


@torch.no_grad()
def test_last_position_logits_match_transformers(qwen05, hf_model):
    model = qwen05.llm_engine.model_runner.model
    for chat in CHATS:
        ids = torch.tensor(qwen05.llm_engine.tokenizer.apply_chat_template(chat)[1])
        hidden = model(ids, torch.arange(len(ids)), AttentionContext.dense([len(ids)]))
        ours, expected = model.compute_logits(hidden)[-1], hf_model(ids[None]).logits[0, -1]
        torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)  # 2-3e-5 measured on these chats


def test_64_greedy_tokens_match_transformers_and_answer(qwen05, hf_model):
    outputs = qwen05.chat(list(CHATS), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                                     eos_token_id=None)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == expected
    assert outputs[0].outputs[0].text.startswith("Paris")
