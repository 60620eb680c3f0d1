"""Scheduler policy with fake sequences: no model, no tensors."""

import pytest

from nebula_engine.config import SchedulerConfig
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence, SequenceStatus
from nebula_engine.kvcache.pool import KVCacheManager, PagePool
from nebula_engine.pic.backends import get_pic_backend
from nebula_engine.pic.segments import segment_token_lists


def make_scheduler(num_pages=64, page_size=4, max_num_batched_tokens=32, max_num_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, KVCacheManager(PagePool(num_pages), page_size))


def seq(seq_id, prompt_len, max_tokens=4):
    return Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def pic_seq(seq_id, prompt_len, max_tokens=4):
    """A PIC request: one regular token, then a PIC segment with the rest of the prompt but its last token."""
    ids = list(range(1, prompt_len + 1))
    segmented = segment_token_lists([("regular", ids[:1]), ("pic", ids[1:-1]), ("regular", ids[-1:])])
    return Sequence(seq_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0), segmented=segmented,
                    pic_backend=get_pic_backend("naive"))


def fake_step(scheduler, token=7):
    """Pretend the model ran: advance, append a token to each sampling sequence, finish at max_tokens."""
    out = scheduler.schedule()
    scheduler.advance(out)
    for entry in out.scheduled + out.combines:
        if entry.samples:
            entry.seq.append_token(token, 0.0)
            if entry.seq.num_output_tokens >= entry.seq.sampling_params.max_tokens:
                scheduler.finish(entry.seq, "length")
    return out


def step_until(scheduler, condition, max_steps=100):
    """Fake steps until ``condition(output)`` holds; returns that step's output."""
    for _ in range(max_steps):
        out = fake_step(scheduler)
        if condition(out):
            return out
    raise AssertionError(f"condition not reached in {max_steps} steps")


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


def combine_plan(out):
    return [(e.seq_id, e.num_computed_tokens, e.num_new_tokens, e.samples) for e in out.combines]


def test_pic_prompt_over_the_leftover_budget_lets_smaller_requests_pass():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add(seq("a", 4, max_tokens=20))
    fake_step(scheduler)  # a decodes from now on: 15 tokens of budget are left each step
    scheduler.add(pic_seq("p", 16))
    scheduler.add(seq("b", 5))
    out = fake_step(scheduler)
    assert plan(out) == [("a", 4, 1), ("b", 0, 5)] and out.combines == ()
    assert [s.seq_id for s in scheduler.waiting] == ["p"] and scheduler.waiting[0].num_times_passed == 1
    assert "p" not in scheduler.kv_cache.block_tables  # a passed request holds no pages


def test_pic_prompt_that_fits_is_combined_in_the_same_step_as_other_work():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add(seq("a", 4, max_tokens=20))
    fake_step(scheduler)
    scheduler.add(pic_seq("p", 12))
    scheduler.add(pic_seq("q", 10))
    scheduler.add(seq("b", 5))
    out = fake_step(scheduler)
    assert plan(out) == [("a", 4, 1), ("b", 0, 5)]
    assert combine_plan(out) == [("p", 0, 12, True), ("q", 0, 10, True)]
    assert out.num_batched_tokens == 28


def test_passed_pic_prompt_is_not_starved_by_a_stream_of_small_requests():
    """After max_num_seqs requests passed it, nobody else does: the running set drains and the combine runs."""
    scheduler = make_scheduler(num_pages=256, max_num_batched_tokens=16, max_num_seqs=3)
    scheduler.add(seq("a", 4, max_tokens=6))
    fake_step(scheduler)
    p = pic_seq("p", 16)  # never fits next to a decode: 15 tokens are left then
    scheduler.add(p)
    for step in range(40):
        scheduler.add(seq(f"s{step}", 2, max_tokens=3))
        out = fake_step(scheduler)
        if out.combines:
            break
    assert combine_plan(out) == [("p", 0, 16, True)] and plan(out) == []  # alone: the running set drained
    assert p.num_times_passed == 3  # max_num_seqs
    assert [s.seq_id for s in scheduler.waiting][:1] != ["p"]


def test_preempted_pic_request_resumes_with_a_combine_of_its_prompt_then_prefills_its_outputs():
    # 8 pages of 4 tokens: a takes 4, p 3; a's fifth page (its 4th output) preempts p, the newest, whose
    # resumed combine then runs while a decodes its last token
    scheduler = make_scheduler(num_pages=8, page_size=4, max_num_batched_tokens=64)
    a, p = seq("a", 14, max_tokens=5), pic_seq("p", 10, max_tokens=10)
    scheduler.add(a)
    scheduler.add(p)
    out = fake_step(scheduler)
    assert plan(out) == [("a", 0, 14)] and combine_plan(out) == [("p", 0, 10, True)]
    out = step_until(scheduler, lambda out: p.num_preemptions)
    assert out.preempted_seq_ids == ("p",) and p.num_output_tokens >= 1
    outputs_at_preemption = p.num_output_tokens
    out = step_until(scheduler, lambda out: out.combines)
    # the prompt again by a combine, which does not sample: p already has its next tokens
    assert combine_plan(out) == [("p", 0, 10, False)] and p.num_output_tokens == outputs_at_preemption
    out = fake_step(scheduler)
    assert ("p", 10, outputs_at_preemption) in plan(out)  # its output tokens by plain prefill, then sampling
    assert next(e for e in out.scheduled if e.seq_id == "p").samples
    step_until(scheduler, lambda out: not scheduler.has_unfinished())
    assert p.output_token_ids == [7] * 10 and scheduler.kv_cache.num_free_pages == 8
