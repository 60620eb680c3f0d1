"""Prefix caching in the engine: hits are reported, skipped, and change no greedy token."""

import pytest
import torch

from nebula_engine import LLM, SamplingParams
from nebula_engine.engine.kv_plan import KVPlan
from nebula_engine.kvcache.events import CacheIndex, CacheKind, EvictEvent, Tier
from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind
from tests.model_cases import CASES_BY_NAME

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SETTINGS = dict(num_pages=96, page_size=8, max_num_batched_tokens=64)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def uncached(qwen3_dir):
    return LLM(str(qwen3_dir), enable_prefix_caching=False, **SETTINGS)


@pytest.fixture(scope="module")
def cached(qwen3_dir):
    """Prefix caching on (the default); tests use disjoint random prompts, so they do not hit each other."""
    return LLM(str(qwen3_dir), **SETTINGS)


def test_same_long_prompt_twice_is_served_from_cache_with_identical_tokens(cached, uncached):
    prompt = {"prompt_token_ids": random_tokens(300, seed=0)}
    first, second = cached.generate(prompt, GREEDY)[0], cached.generate(prompt, GREEDY)[0]
    [reference] = uncached.generate(prompt, GREEDY)
    assert first.num_cached_tokens == 0 and reference.num_cached_tokens == 0
    assert second.num_cached_tokens == 296  # every full page before the last prompt token
    assert second.num_cached_tokens >= 0.9 * len(prompt["prompt_token_ids"])
    assert token_ids([first, second]) == token_ids([reference, reference])
    torch.testing.assert_close(torch.tensor(second.outputs[0].token_logprobs), torch.tensor(reference.outputs[0].token_logprobs),
                               atol=1e-4, rtol=1e-4)


def test_shared_system_prompt_hits_across_questions(cached, uncached):
    system = random_tokens(64, seed=1)
    questions = [random_tokens(n, seed=10 + n) for n in (5, 13, 21)]
    prompts = [{"prompt_token_ids": system + q} for q in questions]
    cached.generate({"prompt_token_ids": system + random_tokens(7, seed=2)}, GREEDY)
    outputs = cached.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [64, 64, 64]
    assert token_ids(outputs) == token_ids(uncached.generate(prompts, GREEDY))
    cached.llm_engine.scheduler.prefix_cache.cache.check_integrity()


TIERED = dict(num_pages=12, page_size=4, max_num_batched_tokens=64)


def test_cached_pages_are_evicted_to_make_room_and_events_replay_to_the_index(qwen3_dir, uncached):
    # 12 pages of 4 tokens; each 22-token prompt + 4 outputs caches 6 pages: later prompts must evict
    prompts = [{"prompt_token_ids": random_tokens(22, seed=s)} for s in range(4)]
    llm = LLM(str(qwen3_dir), **TIERED)
    kv_cache = llm.llm_engine.scheduler.kv_cache
    outputs = [llm.generate(p, GREEDY)[0] for p in prompts]
    assert token_ids(outputs) == token_ids(uncached.generate(prompts, GREEDY))
    events = kv_cache.cache.drain_events()
    assert any(isinstance(e, EvictEvent) and e.kind is CacheKind.PC for e in events)
    index = CacheIndex(worker=0)
    for event in events:
        index.apply(event)
    assert index == kv_cache.cache.snapshot()
    assert kv_cache.num_free_pages == 12  # cached pages are all reclaimable once idle
    assert llm.generate(prompts[-1], GREEDY)[0].num_cached_tokens == 20


def run_evicting(llm, target, seeds):
    """``target`` once, then prompts whose pages push ``target``'s off the 12-page device pool."""
    first = llm.generate(target, GREEDY)[0]
    for seed in seeds:
        llm.generate({"prompt_token_ids": random_tokens(40, seed=seed)}, GREEDY)
    assert not llm.llm_engine.scheduler.prefix_cache.cache.radix.match_prefix(target["prompt_token_ids"]).pages
    return first


def test_prefix_evicted_to_host_is_promoted_back(qwen3_dir):
    target = {"prompt_token_ids": random_tokens(30, seed=40)}
    llm = LLM(str(qwen3_dir), host_cache_tokens=256, **TIERED)
    first = run_evicting(llm, target, seeds=(41, 42))
    cache = llm.llm_engine.scheduler.prefix_cache.cache
    assert cache.occupancy()[CacheKind.PC, Tier.HOST] > 0
    again = llm.generate(target, GREEDY)[0]
    assert again.num_cached_tokens == 28 and token_ids([again]) == token_ids([first])
    cache.check_integrity()


def test_prefix_on_disk_is_reused_after_a_restart(qwen3_dir, tmp_path):
    target = {"prompt_token_ids": random_tokens(30, seed=50)}
    settings = dict(disk_cache_tokens=1024, disk_cache_path=str(tmp_path), **TIERED)
    llm = LLM(str(qwen3_dir), **settings)
    first = run_evicting(llm, target, seeds=(51, 52))
    llm.llm_engine.scheduler.prefix_cache.cache.flush()
    restarted = LLM(str(qwen3_dir), **settings)
    again = restarted.generate(target, GREEDY)[0]
    assert again.num_cached_tokens == 28 and token_ids([again]) == token_ids([first])


def test_hybrid_linear_attention_model_caches_prefixes_with_their_states(checkpoint_factory):
    """Details in test_hybrid_prefix_caching.py; here: the switch. On by default, off on request."""
    from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager

    checkpoint = checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"])
    llm = LLM(str(checkpoint), num_pages=32, page_size=8)
    kv_cache = llm.llm_engine.scheduler.kv_cache
    assert llm.llm_engine.scheduler.prefix_cache is kv_cache and kv_cache.state_io is not None
    plain = LLM(str(checkpoint), num_pages=32, page_size=8, pic_backend=None, enable_prefix_caching=False)
    assert not isinstance(plain.llm_engine.scheduler.kv_cache, PrefixCachingKVCacheManager)


def test_scheduler_evicts_cached_pages_before_preempting_and_never_caches_the_last_token():
    from nebula_engine.config import SchedulerConfig
    from nebula_engine.engine.scheduler import Scheduler
    from nebula_engine.engine.sequence import Sequence
    from nebula_engine.kvcache.cache_store import CacheStore
    from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager
    from tests.engine.test_scheduler import fake_step

    kv_cache = PrefixCachingKVCacheManager(CacheStore(num_pages=8, page_size=4))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv_cache, kv_cache)

    def run(seq_id, tokens, max_tokens=1):
        seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0))
        scheduler.add(seq)
        first = fake_step(scheduler)
        while scheduler.has_unfinished():
            fake_step(scheduler)
        return seq, first

    _, first = run("a", list(range(1, 17)))  # 16 tokens: 4 pages cached, 4 free
    assert kv_cache.pool.num_free_pages == 4 and kv_cache.num_free_pages == 8
    again, first = run("a2", list(range(1, 17)))
    assert again.num_cached_tokens == 12 and [e.num_new_tokens for e in first.scheduled] == [4]
    # 4 + 3 pages at the peak: room only if 3 of the 4 cached pages of "a" are evicted
    kv_cache.cache.drain_events()
    b = Sequence("b", list(range(100, 112)), SamplingParams(max_tokens=2, temperature=0))
    c = Sequence("c", list(range(200, 208)), SamplingParams(max_tokens=2, temperature=0))
    scheduler.add(b)
    scheduler.add(c)
    while scheduler.has_unfinished():
        assert fake_step(scheduler).preempted_seq_ids == ()
    assert b.num_preemptions == c.num_preemptions == 0
    assert sum(isinstance(e, EvictEvent) for e in kv_cache.cache.drain_events()) >= 3
    kv_cache.cache.check_integrity()


class RowsPageIO:
    """A fake device for scheduler-level tests: one row of 4 floats per page."""

    def __init__(self, num_pages):
        self.rows = torch.zeros(num_pages, 4)

    def read_pages(self, pages):
        return [self.rows[pages].clone()]

    def write_pages(self, pages, data):
        self.rows[pages] = data[0]


def test_disk_hit_waits_in_the_queue_while_others_run_instead_of_blocking_the_step(tmp_path, monkeypatch):
    import threading

    from nebula_engine.config import SchedulerConfig
    from nebula_engine.engine.scheduler import Scheduler
    from nebula_engine.engine.sequence import Sequence
    from nebula_engine.kvcache.cache_store import CacheStore
    from nebula_engine.kvcache.disk_tier import DiskTier
    from nebula_engine.kvcache.prefix_caching import PrefixCachingKVCacheManager
    from nebula_engine.kvcache.tiers import TierConfig
    from tests.engine.test_scheduler import fake_step

    tiers = TierConfig(disk_capacity_tokens=64, disk_path=str(tmp_path))
    kv_cache = PrefixCachingKVCacheManager(CacheStore(8, 4, tiers=tiers, page_io=RowsPageIO(8)))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv_cache, kv_cache)

    def request(seq_id, tokens, max_tokens):
        seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0))
        scheduler.add(seq)
        return seq

    request("a", list(range(1, 17)), max_tokens=1)
    while scheduler.has_unfinished():
        fake_step(scheduler)
    kv_cache.cache.evict(8)  # every cached page of "a" goes to disk
    kv_cache.cache.flush()
    gate = threading.Event()
    load = DiskTier._load
    monkeypatch.setattr(DiskTier, "_load", lambda self, ident: gate.wait(timeout=10) and load(self, ident))
    request("b", list(range(50, 54)), max_tokens=3)
    again = request("a2", list(range(1, 17)), max_tokens=1)
    assert [e.seq_id for e in fake_step(scheduler).scheduled] == ["b"]  # a2's pages are still on their way
    gate.set()
    kv_cache.cache.flush()  # the disk thread has finished the reads
    step = fake_step(scheduler)
    assert [e.seq_id for e in step.scheduled] == ["b", "a2"] and again.num_cached_tokens == 12


def _run_engine(engine) -> dict:
    """Step ``engine`` until idle; the last output of each request."""
    last = {}
    while engine.has_unfinished_requests():
        last.update((output.request_id, output) for output in engine.step())
    return last


def _counting_logits(engine, monkeypatch) -> list[int]:
    """Rows each ``compute_logits`` call of ``engine``'s model got, in order."""
    rows, model = [], engine.model_runner.model
    original = model.compute_logits

    def counted(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    monkeypatch.setattr(model, "compute_logits", counted)
    return rows


def test_a_prefill_only_request_caches_its_prompt_without_computing_logits(cached, uncached, monkeypatch):
    engine = cached.llm_engine
    rows = _counting_logits(engine, monkeypatch)
    lead = random_tokens(40, seed=30)  # 5 full pages
    engine.add_request("lead", lead, GREEDY, kv_plan=KVPlan(prefill_only=True))
    [done] = _run_engine(engine).values()
    assert done.finished and done.outputs[0].token_ids == [] and done.outputs[0].finish_reason == "length"
    assert rows == []  # no logits for it
    prompt = {"prompt_token_ids": lead + random_tokens(9, seed=31)}
    [after] = cached.generate(prompt, GREEDY)
    assert after.num_cached_tokens == 40
    assert token_ids([after]) == token_ids(uncached.generate(prompt, GREEDY))
    cached.llm_engine.scheduler.prefix_cache.cache.check_integrity()


def test_a_prefill_only_request_batched_with_others_changes_none_of_their_tokens(cached, uncached, monkeypatch):
    engine = cached.llm_engine
    rows = _counting_logits(engine, monkeypatch)
    prompt = random_tokens(21, seed=32)
    engine.add_request("lead", random_tokens(24, seed=33), GREEDY, kv_plan=KVPlan(prefill_only=True))
    engine.add_request("other", prompt, GREEDY)
    first_step = engine.step()
    assert [o.request_id for o in first_step if o.finished] == ["lead"] and rows[0] == 1  # one row: "other"'s
    other = _run_engine(engine)["other"]
    assert other.outputs[0].token_ids == token_ids(uncached.generate({"prompt_token_ids": prompt}, GREEDY))[0]


def test_prefill_only_takes_only_a_plain_single_completion_prompt(cached):
    engine, ids = cached.llm_engine, random_tokens(16, seed=34)
    with pytest.raises(ValueError, match="prefill_only"):
        engine.add_request("n2", ids, SamplingParams(n=2, max_tokens=1), kv_plan=KVPlan(prefill_only=True))
    with pytest.raises(ValueError, match="prefill_only"):
        KVPlan(hold=True, prefill_only=True)
    segmented = SegmentedPrompt(tuple(ids), (PromptSegment(SegmentKind.REGULAR, 0, 8),
                                             PromptSegment(SegmentKind.PIC, 8, 8)))
    with pytest.raises(ValueError, match="prefill_only"):
        engine.add_request("pic", segmented, GREEDY, kv_plan=KVPlan(prefill_only=True))
    assert not engine.has_unfinished_requests()
