"""The referee for MLA and hybrid linear-attention models: the engine's greedy tokens equal transformers' generate.

DeepSeek-V2 runs over the latent cache (absorbed decode); Qwen3.5 keeps its linear-attention state in
per-sequence state slots across prefill chunks, decode steps and preemption.
"""

import pytest
import torch

from nebula_engine import LLM
from tests.engine.test_generate_vs_hf import ENGINE_SETTINGS, NUM_TOKENS, PARAMS, hf_greedy
from tests.engine.test_generate_vs_hf import hf_reference  # noqa: F401  (fixture)
from tests.model.test_qwen3_5 import _vision_language_checkpoint
from tests.model_cases import CASES_BY_NAME, HYBRID_AND_MLA_CASES

QWEN3_5_DENSE = CASES_BY_NAME["qwen3_5_linear_full_linear"]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("case", HYBRID_AND_MLA_CASES, ids=str)
def test_greedy_generate_matches_transformers_unbatched_and_batched(case, hf_reference):
    checkpoint, prompts, expected = hf_reference(case)
    llm = LLM(str(checkpoint), **ENGINE_SETTINGS["default_pages"])
    unbatched = [llm.generate({"prompt_token_ids": p}, PARAMS)[0] for p in prompts]
    for output, (tokens, logprobs) in zip(unbatched, expected):
        assert output.outputs[0].token_ids == tokens
        torch.testing.assert_close(torch.tensor(output.outputs[0].token_logprobs), torch.tensor(logprobs),
                                   atol=2e-4, rtol=1e-4)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert _tokens(batched) == _tokens(unbatched)


@pytest.mark.parametrize("case", HYBRID_AND_MLA_CASES, ids=str)
def test_greedy_generate_matches_transformers_with_chunking_and_preemption(case, hf_reference):
    checkpoint, prompts, expected = hf_reference(case)
    llm = LLM(str(checkpoint), **ENGINE_SETTINGS["small_pages_chunked_preempting"])
    engine = llm.llm_engine
    preemptions = []
    schedule = engine.scheduler.schedule

    def spy():  # record preemptions: the recompute path (and, for Qwen3.5, state rebuilt from scratch) must run
        output = schedule()
        preemptions.extend(output.preempted_seq_ids)
        return output

    engine.scheduler.schedule = spy
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert _tokens(batched) == [tokens for tokens, _ in expected]
    assert preemptions, "the small pool was meant to force preemption"
    kv = engine.scheduler.kv_cache
    assert kv.num_free_pages == 20 and not kv.block_tables
    if kv.state_slots is not None:
        assert kv.state_slots.num_free == kv.state_slots.num_slots and not kv.state_slots.slot_of


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=48, page_size=8)],
                         ids=["one_prefill", "chunked_prefill"])
def test_qwen3_5_decode_after_prefill_longer_than_one_delta_rule_chunk(settings, checkpoint_factory):
    checkpoint = checkpoint_factory(QWEN3_5_DENSE)
    prompt = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(3)).tolist()  # > 64-token chunk
    [(tokens, logprobs)] = hf_greedy(checkpoint, [prompt])
    output = LLM(str(checkpoint), **settings).generate({"prompt_token_ids": prompt}, PARAMS)[0].outputs[0]
    assert output.token_ids == tokens and len(tokens) == NUM_TOKENS
    torch.testing.assert_close(torch.tensor(output.token_logprobs), torch.tensor(logprobs), atol=2e-4, rtol=1e-4)


def test_qwen3_5_vision_language_checkpoint_through_the_engine(hf_reference, tmp_path):
    text_dir, prompts, expected = hf_reference(QWEN3_5_DENSE)
    vl_dir = _vision_language_checkpoint(text_dir, tmp_path / "vl")
    outputs = LLM(str(vl_dir), **ENGINE_SETTINGS["default_pages"]).generate(
        [{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert _tokens(outputs) == [tokens for tokens, _ in expected]


def test_deepseek_pool_stores_only_the_latent_per_token(checkpoint_factory):
    """Per token and layer the pool holds R + Dr values (c̃ and k_pe), not H·(D + Dv) decompressed K/V."""
    case = CASES_BY_NAME["deepseek_v2_qlora_group_limited"]
    llm = LLM(str(checkpoint_factory(case)), page_size=4, num_pages=10)
    config = llm.llm_engine.model_config.hf_config
    latent_bytes = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    storage = llm.llm_engine.model_runner.kv_storage
    pool_bytes = sum(t.numel() * t.element_size() for layer in storage.layer_caches for t in layer)
    assert pool_bytes == latent_bytes * 10 * 4
    assert latent_bytes < config["num_hidden_layers"] * config["num_attention_heads"] * 4 * (
        config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"])
