"""Scheduler policy with fake sequences: no model, no tensors."""

import pytest

from nebula_engine.config import SchedulerConfig
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence, SequenceStatus
from nebula_engine.kvcache.pool import KVCacheManager


def make_scheduler(num_pages=64, page_size=4, max_num_batched_tokens=32, max_num_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, KVCacheManager(num_pages, page_size))


def seq(seq_id, prompt_len, max_tokens=4):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def fake_step(scheduler, token=7):
    """Pretend the model ran: advance, append a token to each sampling sequence, finish at max_tokens."""
    out = scheduler.schedule()
    scheduler.advance(out)
    for entry in out.scheduled:
        if entry.samples:
            entry.seq.append_token(token, 0.0)
            if entry.seq.num_output_tokens >= entry.seq.sampling_params.max_tokens:
                scheduler.finish(entry.seq, "length")
    return out


def plan(out):
    return [(e.seq_id, e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled]


def test_long_prompt_is_chunked_under_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(seq("a", 20))
    steps = [plan(fake_step(scheduler)) for _ in range(3)]
    assert steps == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)]]
    out = fake_step(scheduler)
    assert plan(out) == [("a", 20, 1)]  # now decoding the token sampled after the last chunk


def test_only_the_chunk_that_completes_the_prompt_samples():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(seq("a", 12))
    first, second = scheduler.schedule(), None
    assert not first.scheduled[0].samples
    scheduler.advance(first)
    second = scheduler.schedule()
    assert second.scheduled[0].samples


def test_new_prefill_joins_running_decodes_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add(seq("a", 6))
    scheduler.add(seq("b", 3))
    assert plan(fake_step(scheduler)) == [("a", 0, 6), ("b", 0, 3)]
    scheduler.add(seq("c", 30))
    out = fake_step(scheduler)
    assert plan(out) == [("a", 6, 1), ("b", 3, 1), ("c", 0, 8)]
    assert out.num_batched_tokens == 10


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(seq(name, 2))
    assert [e.seq_id for e in fake_step(scheduler).scheduled] == ["a", "b"]
    assert [s.seq_id for s in scheduler.waiting] == ["c"]


def test_pool_exhaustion_preempts_the_newest_and_it_still_completes():
    # 4 pages of 4 tokens: a and b each take 2 pages for their prompt + first decode tokens
    scheduler = make_scheduler(num_pages=4, page_size=4, max_num_batched_tokens=64)
    a, b = seq("a", 7, max_tokens=6), seq("b", 7, max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)  # both prefilled: 2 pages each, pool full
    fake_step(scheduler)  # decode at position 7 still fits in page 2
    out = scheduler.schedule()  # position 8 needs a third page for a: b is preempted
    assert out.preempted_seq_ids == ("b",)
    assert plan(out) == [("a", 8, 1)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "b" not in scheduler.kv_cache.block_tables
    scheduler.advance(out)
    a.append_token(7, 0.0)
    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        fake_step(scheduler)
    assert a.is_finished and b.is_finished
    assert b.output_token_ids == [7] * 6 and b.prompt_token_ids == list(range(1, 8))
    assert scheduler.kv_cache.num_free_pages == 4


def test_preempted_sequence_recomputes_prompt_and_outputs():
    scheduler = make_scheduler(num_pages=4, page_size=4, max_num_batched_tokens=64)
    a, b = seq("a", 7, max_tokens=6), seq("b", 7, max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)
    fake_step(scheduler)
    fake_step(scheduler)  # b preempted with 2 output tokens
    assert b.num_output_tokens == 2
    while scheduler.waiting and scheduler.waiting[0] is b:
        out = fake_step(scheduler)
    readmission = next(e for e in out.scheduled if e.seq_id == "b")
    assert (readmission.num_computed_tokens, readmission.num_new_tokens) == (0, 9)
    assert readmission.samples


def test_sequence_that_must_preempt_itself_waits_and_no_waiting_request_is_admitted():
    scheduler = make_scheduler(num_pages=2, page_size=4, max_num_batched_tokens=64)
    a = seq("a", 4, max_tokens=8)
    scheduler.add(a)
    fake_step(scheduler)
    b = seq("b", 3)
    scheduler.add(b)
    out = scheduler.schedule()  # a decodes into page 1, b cannot get a page
    assert plan(out) == [("a", 4, 1)]
    assert [s.seq_id for s in scheduler.waiting] == ["b"]


def test_finished_ids_are_reported_once():
    scheduler = make_scheduler()
    scheduler.add(seq("a", 2, max_tokens=1))
    fake_step(scheduler)
    scheduler.add(seq("b", 2))
    assert scheduler.schedule().finished_seq_ids == ("a",)
    assert scheduler.schedule().finished_seq_ids == ()


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_every_request_finishes_with_exact_page_accounting(budget):
    scheduler = make_scheduler(num_pages=6, page_size=2, max_num_batched_tokens=budget, max_num_seqs=3)
    seqs = [seq(f"s{i}", 1 + (5 * i) % 7, max_tokens=1 + i % 4) for i in range(8)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        out = fake_step(scheduler)
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= 3
    assert all(s.is_finished and s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    assert scheduler.kv_cache.num_free_pages == 6
