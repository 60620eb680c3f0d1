"""Prefix caching on a hybrid model (Qwen3.5, tiny and random): a cached prefix carries the linear-attention state
after it, in pool pages; a hit restores it and changes no token; the states are counted, evicted and freed."""

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.kvcache.events import CacheKind, EvictEvent
from tests.model_cases import CASES_BY_NAME

QWEN3_5 = CASES_BY_NAME["qwen3_5_linear_full_linear"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SETTINGS = dict(page_size=8, num_pages=160, max_num_batched_tokens=64)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory):
    return checkpoint_factory(QWEN3_5)


@pytest.fixture(scope="module")
def uncached(checkpoint):
    return LLM(str(checkpoint), enable_prefix_caching=False, **SETTINGS)


@pytest.fixture(scope="module")
def cached(checkpoint):
    """Prefix caching on (the default); tests use disjoint random prompts, so they do not hit each other."""
    return LLM(str(checkpoint), **SETTINGS)


def nodes_with_state(llm) -> int:
    return sum(1 for node in llm.llm_engine.cache_store.radix.nodes() if node.state_pages)


def test_repeated_prompt_is_served_from_cache_with_identical_tokens_and_logprobs(cached, uncached):
    prompt = {"prompt_token_ids": random_tokens(150, seed=0)}
    first, second = cached.generate(prompt, GREEDY)[0], cached.generate(prompt, GREEDY)[0]
    [reference] = uncached.generate(prompt, GREEDY)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 144  # every full page before the last prompt token
    assert second.num_cached_tokens >= 0.9 * len(prompt["prompt_token_ids"])
    assert token_ids([first, second]) == token_ids([reference, reference])
    torch.testing.assert_close(torch.tensor(second.outputs[0].token_logprobs),
                               torch.tensor(reference.outputs[0].token_logprobs), atol=1e-4, rtol=1e-4)
    cached.llm_engine.cache_store.check_integrity()


def test_a_prefill_step_ends_at_the_prompt_checkpoint(checkpoint):
    llm = LLM(str(checkpoint), **SETTINGS)
    engine = llm.llm_engine
    steps = []
    schedule = engine.scheduler.schedule

    def spy():
        output = schedule()
        steps.extend(s.num_new_tokens for s in output.scheduled)
        return output

    engine.scheduler.schedule = spy
    llm.generate({"prompt_token_ids": random_tokens(150, seed=1)}, SamplingParams(max_tokens=1))
    # 64-token chunks, then a step ending at token 144 (the last full page before the last token), then the rest
    assert steps == [64, 64, 16, 6]
    assert nodes_with_state(llm) == 1


def test_a_longer_prompt_built_on_a_cached_one_starts_from_its_checkpoint(cached, uncached):
    turn1 = random_tokens(100, seed=2)
    answer = cached.generate({"prompt_token_ids": turn1}, GREEDY)[0].outputs[0].token_ids
    turn2 = {"prompt_token_ids": turn1 + answer + random_tokens(37, seed=3)}
    [second] = cached.generate(turn2, GREEDY)
    assert second.num_cached_tokens == 96  # turn 1's checkpoint: its last full page before its last token
    assert token_ids([second]) == token_ids(uncached.generate(turn2, GREEDY))


def test_a_shared_prefix_is_used_only_up_to_a_saved_state(cached, uncached):
    system = random_tokens(64, seed=4)
    first = {"prompt_token_ids": system + random_tokens(20, seed=5)}  # its state is saved after token 80
    other = {"prompt_token_ids": system + random_tokens(20, seed=6)}
    cached.generate(first, GREEDY)
    # the system prompt's 8 pages are cached, but no state after them: the match cannot be used
    [miss] = cached.generate(other, GREEDY)
    assert miss.num_cached_tokens == 0
    assert token_ids([miss]) == token_ids(uncached.generate(other, GREEDY))
    assert cached.generate(first, GREEDY)[0].num_cached_tokens == 80


def test_states_take_pool_pages_are_evicted_with_their_nodes_and_freed(checkpoint, uncached):
    llm = LLM(str(checkpoint), page_size=8, num_pages=48, max_num_batched_tokens=64)
    engine = llm.llm_engine
    kv, store = engine.scheduler.kv_cache, engine.cache_store
    state_pages = kv.state_io.num_pages
    storage = engine.model_runner.kv_storage
    state_bytes = sum(t[0].numel() * t[0].element_size() for pair in storage.linear_states for t in pair)
    assert state_pages == -(-state_bytes // kv.state_io.blob.page_bytes)
    prompts = [{"prompt_token_ids": random_tokens(90, seed=10 + i)} for i in range(4)]
    outputs = [llm.generate(p, GREEDY)[0] for p in prompts[:1]]
    # idle after one request: its 11 prompt pages (+ the decode's full pages) and one state are all that is used
    cached_pages = sum(1 for _ in store.radix.nodes())
    assert kv.pool.num_pages - kv.pool.num_free_pages == cached_pages + state_pages
    assert store.radix.total_size == (cached_pages + state_pages) * 8
    outputs += [llm.generate(p, GREEDY)[0] for p in prompts[1:]]  # 4 x (12 + state) pages overflow 48
    events = store.drain_events()
    assert any(isinstance(e, EvictEvent) and e.kind is CacheKind.PC for e in events)
    assert nodes_with_state(llm) < 4
    assert token_ids(outputs) == token_ids(uncached.generate(prompts, GREEDY))
    store.check_integrity()
    assert llm.llm_engine.reset_prefix_cache()
    assert kv.pool.num_free_pages == 48 and store.radix.total_size == 0
    assert llm.generate(prompts[-1], GREEDY)[0].num_cached_tokens == 0


def test_hypic_transition_states_live_in_pool_pages(checkpoint):
    llm = LLM(str(checkpoint), page_size=4, num_pages=256, pic_backend="hypic:seam=4")
    store = llm.llm_engine.cache_store
    segments = [("regular", random_tokens(4, seed=20)), ("pic", random_tokens(24, seed=21)),
                ("pic", random_tokens(24, seed=22)), ("regular", random_tokens(8, seed=23))]
    first = llm.generate({"segments": segments}, GREEDY)[0]
    entries = list(store.pic.entries())
    assert len(entries) == 2 and store.num_states_outside_pages == 0
    for entry in entries:
        # 24 tokens = 6 pages of K/V, plus the pages of its maps (M, N and conv per linear layer)
        assert entry.state_pages and entry.size == 24 + len(entry.state_pages) * 4
        assert "M" in entry.state["linear"][0]
    pages_used = sum(len(e.pages) + len(e.state_pages) for e in entries)
    used = store.pool.num_pages - store.pool.num_free_pages
    assert used == sum(1 for _ in store.radix.nodes()) + pages_used  # idle: only the caches
    again = llm.generate({"segments": segments}, GREEDY)[0]  # both segments hit: maps read back from pages
    assert token_ids([again]) == token_ids([first]) and llm.llm_engine.model_runner.pic_executor.stats.segment_hits == 2
    store.check_integrity()
    assert llm.llm_engine.reset_prefix_cache() and store.pool.num_free_pages == 256
