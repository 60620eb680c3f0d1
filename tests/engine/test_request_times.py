"""The scheduler's request stamps (first scheduled, first token) on a fake clock, the queue and prefill times a
request's output carries, and the KV-cache usage fraction: no model, no tensors."""

from nebula_engine.config import SchedulerConfig
from nebula_engine.engine.outputs import RequestTimes
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import Scheduler
from nebula_engine.engine.sequence import Sequence
from nebula_engine.kvcache.pool import KVCacheManager, PagePool


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler_on(clock, num_pages=16, max_num_batched_tokens=8):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, KVCacheManager(PagePool(num_pages), page_size=4), clock=clock)


def test_queue_and_prefill_times_run_from_arrival_to_first_schedule_to_first_token():
    clock = FakeClock()
    scheduler = scheduler_on(clock)
    seq = Sequence("a", list(range(1, 13)), SamplingParams(max_tokens=3), arrival_time=clock.now)
    scheduler.add(seq)
    clock.now += 2.0  # waits in the queue
    first_chunk = scheduler.schedule()
    assert seq.first_scheduled_time == 102.0 and seq.times is None
    clock.now += 0.5
    scheduler.advance(first_chunk)  # 8 of 12 prompt tokens: no token sampled yet
    assert seq.first_token_time is None
    second_chunk = scheduler.schedule()
    clock.now += 0.25
    scheduler.advance(second_chunk)  # the prompt's end: its first token
    seq.append_token(5, 0.0)
    assert seq.times == RequestTimes(queued=2.0, prefill=0.75)
    clock.now += 1.0
    scheduler.advance(scheduler.schedule())  # a decode step moves neither stamp
    assert seq.times == RequestTimes(queued=2.0, prefill=0.75)


def test_a_preempted_sequence_keeps_its_first_stamps():
    clock = FakeClock()
    scheduler = scheduler_on(clock, num_pages=2)
    older = Sequence("older", [1, 2, 3, 4], SamplingParams(max_tokens=8), arrival_time=clock.now)
    newer = Sequence("newer", [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=clock.now)
    scheduler.add(older)
    scheduler.add(newer)
    clock.now += 1.0
    scheduler.advance(scheduler.schedule())  # one page each; both sample their first token
    older.append_token(5, 0.0)
    newer.append_token(5, 0.0)
    clock.now += 5.0
    out = scheduler.schedule()  # the older one's fifth token needs a second page: the newer one is preempted
    assert out.preempted_seq_ids == ("newer",)
    scheduler.finish(older, "stop")
    scheduler.advance(scheduler.schedule())  # the newer one is recomputed, later
    assert newer.num_preemptions == 1 and newer.times == RequestTimes(queued=1.0, prefill=0.0)


def test_kv_cache_usage_is_the_fraction_of_pages_sequences_hold():
    scheduler = scheduler_on(FakeClock(), num_pages=16)
    assert scheduler.kv_cache_usage == 0.0
    scheduler.add(Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=2)))
    scheduler.schedule()  # 8 tokens: 2 pages of 4
    assert scheduler.kv_cache_usage == 2 / 16
    scheduler.finish(scheduler.running[0], "length")
    assert scheduler.kv_cache_usage == 0.0
