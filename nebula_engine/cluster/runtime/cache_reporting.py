"""What one worker tells the router: its engine's cache events and its task completions, numbered in one sequence.

PIC events go as the engine made them; the prefix cache is reported per prompt segment (one PC entry per cached
block of a prompt, ``block_segments``), and of the engine's PC page events only the loss of the segments whose last
page leaves the device.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Callable

import msgspec

from nebula_engine.cluster.control.request_keys import block_segments, prompt_keys
from nebula_engine.cluster.runtime import wire
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.kvcache.events import CacheEvent, CacheKind, EvictEvent, MoveEvent, StoreEvent, Tier
from nebula_engine.pic.segments import SegmentedPrompt


@dataclass
class CacheCounts:
    """Entries that left this worker's device cache (dropped or moved to a lower tier), by kind, counted from its
    engine's cache events."""

    pc: int = 0  # prefix-cache pages
    pic: int = 0  # PIC segments

    def count_left_device(self, kind: CacheKind, entries: int) -> None:
        if kind is CacheKind.PC:
            self.pc += entries
        else:
            self.pic += entries


class CacheReporter:
    """``send``: the peer's one send path (to itself included: a report reaches its own router while it leads)."""

    def __init__(self, name: str, role: str, worker_index: int, kv: KVPort,
                 send: Callable[[str, wire.Msg], None], leader: Callable[[], str | None],
                 pic_key: Callable[[str | None, list[int]], str]):
        self.name, self.role, self.worker_index = name, role, worker_index
        self.kv = kv
        self.send = send
        self.leader = leader
        self.pic_key = pic_key
        self.pc_page_keys: dict[str, set[str]] = {}  # radix page hash -> segment chain keys ending in it
        self._next_seq = 1  # sequence number of the next event reported to the router (cache events and task done)
        self.evictions = CacheCounts()

    def report(self, message: wire.Msg) -> None:
        leader = self.leader()
        if leader is not None:
            self.send(leader, message)

    def task_done(self, task_id: str, request_id: str, transfers: list[wire.TransferTime] = ()) -> None:
        self.report(wire.TaskDone(sender=self.name, worker_index=self.worker_index, task_id=task_id,
                                  seq=self.take_seqs(1), request_id=request_id, transfers=list(transfers)))

    def take_seqs(self, count: int) -> int:
        """The first of ``count`` fresh sequence numbers. Taken right before the report is sent (no await in
        between), so numbers increase in send order on the ordered channel to the router."""
        first, self._next_seq = self._next_seq, self._next_seq + count
        return first

    def report_events(self, events: list[CacheEvent], snapshot: bool = False) -> None:
        """Send ``events`` renumbered in this worker's sequence (the engine's own numbers count cache events only)."""
        first = self.take_seqs(len(events))
        numbered = [msgspec.structs.replace(event, worker=self.worker_index, seq=first + i)
                    for i, event in enumerate(events)]
        self.report(wire.CacheEventMsg(sender=self.name, worker_index=self.worker_index, events=numbered,
                                       snapshot=snapshot))

    def report_prompt_cached(self, segmented: SegmentedPrompt, spec: str | None) -> None:
        """Ask the engine thread to report the prompt's cached blocks as PC entries (``block_segments``)."""
        asyncio.get_running_loop().create_task(self.pc_events(segmented, spec))

    async def pc_events(self, segmented: SegmentedPrompt, spec: str | None) -> None:
        if not self.kv.caches_prefixes:
            return
        blocks = block_segments([(s.kind.value, segmented.segment_ids(s)) for s in segmented.segments])
        keys = prompt_keys("", blocks, lambda ids: self.pic_key(spec, ids))
        ends = itertools.accumulate(len(ids) for _, ids in blocks)
        page_counts = [-(-end // self.kv.page_size) for end in ends]
        # one hash per block whose last page is cached, up to the first that is not (or no longer) cached
        hashes = await self.kv.cached_prefix_hashes(list(segmented.token_ids), page_counts)
        events = []
        for num_tokens, key, block_hash in zip(keys.tokens, keys.pc_keys, hashes):
            self.pc_page_keys.setdefault(block_hash, set()).add(key)
            events.append(StoreEvent(self.worker_index, 0, CacheKind.PC, (key,), num_tokens))
        if events:
            self.report_events(events)

    async def pump_events(self, snapshot: bool = False) -> None:
        """Send the engine's cache events since the last call (or, with ``snapshot``, its whole PIC index)."""
        if self.role != "prefill":
            return

        drained = await self.kv.drain_cache_events(snapshot)
        if snapshot:  # every PIC entry with the tier it is on (PC is reported per segment, by pc_events)
            events = [StoreEvent(self.worker_index, 0, CacheKind.PIC, (key,), tokens, tier)
                      for key, tokens, tier in drained.pic_entries]
        else:
            events = [event for raw in drained.events for event in self.for_router(raw)]
        if events or snapshot:
            self.report_events(events, snapshot)

    def for_router(self, event: CacheEvent) -> list[CacheEvent]:
        """What the router hears of one engine event: a PIC event as it is; of a PC page event only the loss of
        the prompt segments whose last page it takes off the device (PC stores are reported by ``pc_events``)."""
        left_device = ((isinstance(event, EvictEvent) and event.tier is Tier.DEVICE)
                       or (isinstance(event, MoveEvent) and event.src is Tier.DEVICE))
        if left_device:
            self.evictions.count_left_device(event.kind, len(event.keys))
        if event.kind is CacheKind.PIC:
            return [event]
        if isinstance(event, EvictEvent) or (isinstance(event, MoveEvent) and event.dst is not Tier.DEVICE):
            return [EvictEvent(self.worker_index, 0, CacheKind.PC, (key,), 0)
                    for page in event.keys for key in self.pc_page_keys.pop(page, ())]
        return []
