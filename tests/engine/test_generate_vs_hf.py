"""The referee: greedy tokens and logprobs of LLM.generate equal transformers' generate."""

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from tests.model_cases import MODEL_CASES

NUM_TOKENS = 16
PROMPT_LENGTHS = (3, 11, 29)


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab_size, 30000), (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(checkpoint, prompts):
    """(tokens, logprobs) per prompt from HF generate, one prompt at a time, EOS disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


ENGINE_SETTINGS = {
    "default_pages": dict(page_size=16, num_pages=64),
    # 4-token pages, 7-token chunks, and 20 pages (80 tokens) for 3 sequences that end at 19 + 27 + 45
    # tokens: chunked prefill, multi-page block tables and preemption by recompute all happen
    "small_pages_chunked_preempting": dict(page_size=4, num_pages=20, max_num_batched_tokens=7),
}
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(checkpoint_factory):
    """Per case: (checkpoint, prompts, HF results), computed once for both tests."""
    cache = {}

    def get(case):
        if case.name not in cache:
            checkpoint = checkpoint_factory(case)
            from nebula_engine.model.config import ModelConfig

            prompts = prompts_for(ModelConfig.from_hf(checkpoint).vocab_size)
            cache[case.name] = checkpoint, prompts, hf_greedy(checkpoint, prompts)
        return cache[case.name]

    return get


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_greedy_generate_matches_transformers_batched_and_unbatched(case, hf_reference):
    checkpoint, prompts, expected = hf_reference(case)
    llm = LLM(str(checkpoint), **ENGINE_SETTINGS["default_pages"])
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    for output, prompt, (tokens, logprobs) in zip(batched, prompts, expected):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == tokens
        assert output.outputs[0].finish_reason == "length"
        torch.testing.assert_close(torch.tensor(output.outputs[0].token_logprobs), torch.tensor(logprobs),
                                   atol=2e-4, rtol=1e-4)
    unbatched = [llm.generate({"prompt_token_ids": p}, PARAMS)[0].outputs[0].token_ids for p in prompts]
    assert unbatched == [tokens for tokens, _ in expected]


@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_greedy_generate_matches_transformers_with_chunking_and_preemption(case, hf_reference):
    checkpoint, prompts, expected = hf_reference(case)
    llm = LLM(str(checkpoint), **ENGINE_SETTINGS["small_pages_chunked_preempting"])
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert [o.outputs[0].token_ids for o in batched] == [tokens for tokens, _ in expected]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.kv_cache.num_free_pages == 20
