"""The engine's two ports on a running tiny engine: each cache operation and request a peer needs, done on the engine
thread, and the round trips peers make with them (pin, copy the pages as NIXL would, store on the reader)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from nebula_engine.cluster.runtime.cost_profile import measured_cluster_config
from nebula_engine.cluster.runtime.launcher import local_spec
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.port_types import KVGeometry
from nebula_engine.engine.request_port import RequestPort
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.devices import machine_cores
from nebula_engine.kvcache.events import Tier
from nebula_engine.pic.backends import PIC_BACKENDS

PAGE = 4  # the engine fixture's page size


@pytest.fixture(scope="module")
def port(engine) -> KVPort:
    return KVPort(engine)


@pytest.fixture(scope="module")
def requests(engine) -> RequestPort:
    return RequestPort(engine)


def run(coro):
    return asyncio.run(coro)


def copy_pages(port: KVPort, src: list[int], dst: list[int]) -> None:
    """What a NIXL read does: the K/V of pages ``src`` into pages ``dst``."""
    for tensor in port.transfer_tensors():
        tensor[list(dst)] = tensor[list(src)]


def segment(first: int, length: int = 3 * PAGE) -> list[int]:
    return list(range(first, first + length))


def test_the_port_reads_the_engine_geometry(port, engine):
    geometry = port.kv_geometry
    assert geometry.page_size == port.page_size == PAGE and geometry.num_pages == 256
    assert geometry.bytes_per_token > 0
    assert port.caches_prefixes
    assert port.pic_backend_name == engine.engine.pic_backend.name  # what the planner costs combines by
    assert port.segment_key("epic", segment(100)) == engine.engine.segment_key("epic", segment(100)) != ""


def test_cache_operations_hold_the_engine_cache_lock(port, engine, monkeypatch):
    held = []
    pool = engine.engine.cache_store.pool
    for name in ("allocate", "release"):
        original = getattr(pool, name)

        def recorded(*args, _original=original, **kwargs):
            held.append((threading.current_thread().name, engine.engine.cache_lock.held()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(pool, name, recorded)

    async def allocate_and_release():
        pages = await port.allocate_pages(2)
        await port.release_pages(pages)

    run(allocate_and_release())
    assert [locked for _, locked in held] == [True, True]
    assert all(name.startswith("nebula-engine-cache") for name, _ in held)


def test_a_segment_is_pinned_while_a_step_computes(port, engine, monkeypatch):
    """The pin a remote reader waits for is served during the engine's forward, not after the step."""
    ids = segment(500)
    key = port.segment_key("epic", ids)
    run(port.prefill_segment("epic", ids))
    model = engine.engine.model_runner.model
    forward = model.forward
    in_forward, pinned = threading.Event(), threading.Event()
    outcome = {}

    def blocking_forward(*args, **kwargs):
        in_forward.set()
        outcome["pinned during the forward"] = pinned.wait(timeout=60)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", blocking_forward)

    async def request_and_pin():
        async def request():
            async for _ in engine.generate("pinned-mid-step", list(range(40, 60)), SamplingParams(max_tokens=1)):
                pass

        running = asyncio.ensure_future(request())
        assert await asyncio.to_thread(in_forward.wait, 60)
        pin = await port.pin_segment(key, len(ids))
        pinned.set()
        await running
        await port.unpin_segment(pin)
        return pin

    pin = run(request_and_pin())
    assert pin is not None and outcome == {"pinned during the forward": True}


def test_a_segment_is_pinned_while_a_combine_computes(port, engine, monkeypatch):
    """A PIC combine lets go of the cache lock for its forward too: a pin waits for neither."""
    from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind

    held, reused = segment(600), segment(706, 24)
    key = port.segment_key("epic", held)
    run(port.prefill_segment("epic", held))
    run(port.prefill_segment("epic", reused))  # the request's segment is cached: its one forward is the combine
    model = engine.engine.model_runner.model
    run_layers = model.run_layers
    in_combine, pinned = threading.Event(), threading.Event()
    outcome = {}

    def blocking_run_layers(*args):
        in_combine.set()
        outcome.setdefault("pinned during the combine", pinned.wait(timeout=60))
        return run_layers(*args)

    monkeypatch.setattr(model, "run_layers", blocking_run_layers)
    prompt = SegmentedPrompt(tuple(range(700, 742)), (PromptSegment(SegmentKind.REGULAR, 0, 6),
                                                      PromptSegment(SegmentKind.PIC, 6, 24),
                                                      PromptSegment(SegmentKind.REGULAR, 30, 12)))

    async def combine_and_pin():
        async def request():
            async for output in engine.generate("pinned-mid-combine", prompt, SamplingParams(max_tokens=1), "epic"):
                last = output
            return last

        running = asyncio.ensure_future(request())
        assert await asyncio.to_thread(in_combine.wait, 60)
        pin = await port.pin_segment(key, len(held))
        pinned.set()
        output = await running
        await port.unpin_segment(pin)
        return pin, output

    pin, output = run(combine_and_pin())
    assert pin is not None and outcome == {"pinned during the combine": True}
    assert output.num_pic_cached_tokens > 0  # it was a combine over the cached segment


def test_a_pinned_segment_copied_into_fresh_pages_is_found_under_its_key_on_the_reader(port):
    ids = segment(200)
    key, copy_key = port.segment_key("epic", ids), "copied-" + port.segment_key("epic", ids)

    async def round_trip():
        await port.prefill_segment("epic", ids)
        pin = await port.pin_segment(key, len(ids))
        assert pin is not None and len(pin.pages) == len(ids) // PAGE
        pages = await port.allocate_pages(len(pin.pages), unless_cached=copy_key)
        copy_pages(port, pin.pages, pages)
        await port.unpin_segment(pin)
        await port.import_segment(copy_key, len(ids), pages, pin.state)
        assert await port.allocate_pages(1, unless_cached=copy_key) is None  # already stored here
        copied = await port.pin_segment(copy_key, len(ids))
        await port.unpin_segment(copied)
        return copied

    copied = run(round_trip())
    assert copied is not None and len(copied.pages) == len(ids) // PAGE
    assert run(port.pin_segment("no such key", 4)) is None


def test_only_missing_segments_are_prefilled(port):
    cached, cold = segment(300), segment(400)
    run(port.prefill_segment("epic", cached))
    assert run(port.prefill_missing_segments("epic", [cached, cold])) == [False, True]
    assert run(port.prefill_missing_segments("epic", [cached, cold])) == [False, False]
    assert run(port.prefill_missing_segments(None, [segment(500)])) == [False]  # no PIC: nothing to prefill


def test_the_loaded_model_records_no_autograd_history(engine):
    model = engine.engine.model_runner.model
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_segments_prefilled_for_peers_leave_no_autograd_history_in_the_pool(port, engine):
    """A scatter and a home's own cold segments are prefilled between engine steps, outside the step's inference
    mode. Run with grad enabled and weights that require it, the forward wrote K/V carrying autograd history into
    the pool, and the pool then held every such forward's activations alive (nebula peers grew by ~1 GB)."""
    model = engine.engine.model_runner.model
    model.requires_grad_(True)  # as before the loader turned it off: the executor alone must prevent history
    try:
        run(port.prefill_segment("epic", segment(900)))
        run(port.prefill_missing_segments("epic", [segment(950), segment(1000)]))
    finally:
        model.requires_grad_(False)
    for tensor in port.transfer_tensors():
        assert not tensor.requires_grad and tensor.grad_fn is None


def test_a_segment_promoted_from_the_host_tier_is_not_reported_as_prefilled(checkpoint_factory):
    """It existed before the request (on a lower tier), so it is a hit, not a segment made for the request."""
    from nebula_engine.config import EngineConfig
    from nebula_engine.engine.async_engine import AsyncLLMEngine
    from tests.model_cases import CASES_BY_NAME

    model = checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])
    tiered = AsyncLLMEngine.from_config(EngineConfig.create(str(model), page_size=PAGE, num_pages=64,
                                                            host_cache_tokens=256))
    try:
        tiered_port = KVPort(tiered)
        demoted, cold = segment(300), segment(400)
        run(tiered_port.prefill_segment("epic", demoted))
        assert run(tiered.call(lambda e: e.cache_store.evict_all())) >= 1  # down to the host tier
        drained = run(tiered_port.drain_cache_events(snapshot=True))
        assert (tiered_port.segment_key("epic", demoted), len(demoted), Tier.HOST) in drained.pic_entries
        assert run(tiered_port.prefill_missing_segments("epic", [demoted, cold])) == [False, True]
        drained = run(tiered_port.drain_cache_events(snapshot=True))
        assert (tiered_port.segment_key("epic", demoted), len(demoted), Tier.DEVICE) in drained.pic_entries
    finally:
        tiered.shutdown()


def test_a_pinned_prefix_copied_into_fresh_pages_is_a_prefix_hit_on_the_reader(port, engine):
    prompt, other = segment(600, 5 * PAGE), segment(700, 5 * PAGE)

    async def round_trip():
        async for _ in engine.generate("prefix-source", prompt, SamplingParams(max_tokens=1)):
            pass
        cached = await port.cached_prefix_pages(prompt)
        pin = await port.pin_prefix(prompt)
        pages = await port.allocate_pages(len(pin.pages))
        copy_pages(port, pin.pages, pages)
        await port.unpin_prefix(pin)
        await port.import_prefix(other, pages)
        return cached, await port.cached_prefix_pages(other), await port.cached_prefix_hashes(other, [1, 2, 9])

    cached, copied, hashes = run(round_trip())
    assert cached == copied == 5  # the prompt's five full pages
    assert len(hashes) == 2 and len(set(hashes)) == 2  # 9 pages are not all cached: the list stops there
    assert run(port.pin_prefix(segment(900))) is None


def test_a_reader_imports_only_the_prefix_pages_past_those_it_holds(port, requests, engine):
    """A home holding a prompt's first pages reads the rest of a longer prefix (a lead another peer prefilled) and
    caches them after its own; if its own pages went meanwhile, the read pages are released, not cached."""
    shared, lead = segment(1500, 2 * PAGE), segment(1600, 3 * PAGE)
    pool = engine.engine.cache_store.pool

    async def round_trip(reader_prompt: list[int]):
        async for _ in engine.generate("lead-source", shared + lead, SamplingParams(max_tokens=1)):
            pass
        pin = await port.pin_prefix(shared + lead)
        pages = await port.allocate_pages(len(pin.pages) - 2)
        copy_pages(port, pin.pages[2:], pages)
        await port.unpin_prefix(pin)
        free = pool.num_free_pages
        imported = await port.import_prefix(reader_prompt, pages, 2)
        return imported, await port.cached_prefix_pages(reader_prompt), pool.num_free_pages - free

    run(requests.prefill_prefix("reader-shared", shared))
    reader = shared + segment(1700, 3 * PAGE)  # shares two pages with the source prompt, then differs
    assert run(round_trip(reader)) == (True, 5, 0)  # the three pages now belong to the reader's prefix cache
    stranger = segment(1800, 2 * PAGE) + segment(1700, 3 * PAGE)  # its first two pages are cached nowhere
    assert run(round_trip(stranger)) == (False, 0, 3)  # released


def test_segments_asked_while_the_engine_is_busy_are_prefilled_in_one_forward(port, engine, monkeypatch):
    """A helper's scatters that wait for the engine thread together are prefilled together; a segment whose backend
    spec is bad fails alone."""
    executor = engine.engine.model_runner.pic_executor
    batches = []
    original = executor.lookup_or_prefill_many

    def recorded(backend, segments, context_ids=None):
        batches.append(len(segments))
        return original(backend, segments, context_ids)

    monkeypatch.setattr(executor, "lookup_or_prefill_many", recorded)
    wanted = [segment(2000 + 100 * i) for i in range(3)]
    release = threading.Event()

    async def scenario():
        busy = asyncio.ensure_future(port._call(lambda e: release.wait(10)))  # the engine thread is in a step
        calls = [asyncio.ensure_future(port.prefill_segment("epic", ids)) for ids in wanted]
        bad = asyncio.ensure_future(port.prefill_segment("no-such-backend", segment(2500)))
        await asyncio.sleep(0)  # every call has asked before the engine thread is free
        release.set()
        await busy
        await asyncio.gather(*calls)
        with pytest.raises(ValueError):
            await bad
        pins = [await port.pin_segment(port.segment_key("epic", ids), len(ids)) for ids in wanted]
        for pin in pins:
            if pin is not None:
                await port.unpin_segment(pin)
        return [pin is not None for pin in pins]

    assert run(scenario()) == [True, True, True]
    assert batches == [3]  # one forward for the three (the bad spec never reached the executor)


def test_a_prefilled_lead_enters_the_prefix_cache_and_reports_what_it_held_before(port, requests):
    """A home prefills a waiting combine's lead exactly; the combine then finds it as a prefix hit, and counts as
    hits only the pages that were cached before."""
    lead = segment(1100, 5 * PAGE)
    assert run(requests.prefill_prefix("lead-1", lead)) == 0
    assert run(port.cached_prefix_pages(lead)) == 5
    longer = lead + segment(1200, 3 * PAGE)
    assert run(requests.prefill_prefix("lead-2", longer)) == 5 * PAGE
    assert run(port.cached_prefix_pages(longer)) == 8


def test_a_snapshot_lists_every_pic_entry_on_the_device(port):
    ids = segment(1000)
    run(port.prefill_segment("epic", ids))
    drained = run(port.drain_cache_events(snapshot=True))
    assert (port.segment_key("epic", ids), len(ids), Tier.DEVICE) in drained.pic_entries
    assert run(port.drain_cache_events()).events == [] and run(port.drain_cache_events()).pic_entries == []


def test_stats_profile_and_pc_share(port, requests, engine):
    run(port.prefill_segment("epic", segment(1950)))  # a miss of its own, whichever tests ran before on this engine
    stats = run(port.pic_stats())
    assert stats["segment_misses"] >= 1 and set(stats) >= {"segment_hits", "segment_skipped", "combines"}
    assert requests.stats().alive
    assert run(requests.prefill_seconds_per_token(num_tokens=16, repeats=1)) > 0
    run(port.set_pc_share(0.25))
    assert engine.engine.cache_store.policy.pc_share == 0.25


def test_the_cost_profile_carries_the_engine_geometry_and_the_measured_prefill():
    spec = local_spec(2, 1)
    config = measured_cluster_config(spec, KVGeometry(page_size=4, num_pages=10, bytes_per_token=96), 0.002)
    assert config.num_prefill_workers == 2
    profile = config.profile
    assert profile.kv_bytes_per_token == 96 and profile.cache_capacity_tokens == 40
    assert profile.prefill.per_token_s == 0.002 and profile.gpus_per_node == 3
    assert profile.intra_node.latency_s == spec.remote_read_latency_s
    assert profile.dispatch_s == spec.scatter_dispatch_s
    # peers on this machine share its cores: as many compute at once as it has cores per peer thread
    assert profile.shared_compute and profile.node_cores == max(1.0, machine_cores() / torch.get_num_threads())
    unshared = measured_cluster_config(local_spec(2, 1, shared_cores=False), KVGeometry(4, 10, 96), 0.002)
    assert not unshared.profile.shared_compute  # Algorithm 1: each peer plans as if it had its own cores
    # a home prefills the lead while it waits, unless its engine's combines start at position 0 (hybrid models)
    assert profile.combine_queues and profile.lead_while_waiting and profile.expected_copies_wait
    hybrid = measured_cluster_config(spec, KVGeometry(4, 10, 96), 0.002, lead_while_waiting=False)
    assert not hybrid.profile.lead_while_waiting


def test_the_cost_profile_plans_combines_at_the_cost_of_the_backend_the_peers_run():
    spec, kv = local_spec(2, 1), KVGeometry(4, 10, 96)
    default = measured_cluster_config(spec, kv, 0.002).profile
    assert set(PIC_BACKENDS) <= set(default.combine_cost)  # every backend a peer can run has a measured cost
    for name in PIC_BACKENDS:
        profile = measured_cluster_config(spec, kv, 0.002, pic_backend=name).profile
        assert profile.pic_backend == name and profile.combine_ratio == default.combine_cost[name]
    assert measured_cluster_config(spec, kv, 0.002, pic_backend=None).profile.pic_backend == default.pic_backend
    with pytest.raises(ValueError, match="no combine cost for PIC backend 'mystery'"):
        measured_cluster_config(spec, kv, 0.002, pic_backend="mystery")
