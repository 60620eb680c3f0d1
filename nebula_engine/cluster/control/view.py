"""Cluster view of §5: where cached KV lives (cache view) and how busy each worker is (load view).

Two sources feed it. Optimistic accounting: on dispatch the router records where a plan will leave
KV (unconfirmed, expiring after a TTL) and reserves the plan's compute. Worker events (the KV cache's
own ``kvcache.events``, as the wire delivers them): a store confirms a location (confirmed records never
expire; a late store re-registers an expired one), an evict removes it, a tier move does both, a done
report releases a task's reservation — exactly once, duplicates ignored.

Pure logic: time is always an argument, nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from nebula_engine.cluster.control.config import ViewConfig
from nebula_engine.cluster.control.messages import (Action, CacheEvent, CacheKind, DoneEvent, EvictEvent, MoveEvent,
                                                    PrefillPlan, StoreEvent, Tier, WorkerEvent)
from nebula_engine.kvcache.events import tokens_per_key

PresenceListener = Callable[[CacheKind, str, Tier, bool, int], None]


@dataclass
class HolderRecord:
    num_tokens: int
    tier: Tier
    confirmed: bool
    expires_at: float  # meaningful only while unconfirmed
    # while unconfirmed: the holder's drained-token count (``ClusterView.wait_tokens``) at which the copy should
    # exist, i.e. its count at dispatch plus everything queued there then, the task computing it included
    ready_mark: float = math.inf

    def alive(self, now: float) -> bool:
        return self.confirmed or now < self.expires_at


@dataclass(frozen=True)
class ViewSnapshot:
    """Everything needed to rebuild a view on a new leader after failover."""

    # (kind, key, worker, tokens, tier, confirmed, expires at)
    entries: tuple[tuple[str, str, int, int, str, bool, float], ...]
    reservations: tuple[tuple[str, int, float], ...]  # task id, worker, tokens
    last_seq: tuple[tuple[int, int], ...]


class ClusterView:
    """Cache view + load view for ``num_workers`` prefill workers.

    Invariants: ``outstanding_tokens(w)`` is the sum of live reservations on ``w``, or infinite while ``w`` is
    down (it will finish nothing: no planner puts work there, and it shares no processor); a reservation is
    released at most once; an unconfirmed record is never returned at or after its expiry time; the
    presence listener hears ``(kind, key, tier, True, tokens)`` when a key gains its first holder on a
    tier and ``False`` when it loses its last one there (an optimistic record counts on the device).
    """

    def __init__(self, num_workers: int, config: ViewConfig = ViewConfig(),
                 listener: PresenceListener | None = None):
        self.num_workers = num_workers
        self.config = config
        self._listener = listener
        self._holders: dict[CacheKind, dict[str, dict[int, HolderRecord]]] = {k: {} for k in CacheKind}
        self._expiry_heap: list[tuple[float, str, str, int]] = []
        self._reservations: dict[str, tuple[int, float]] = {}
        self._outstanding = [0.0] * num_workers
        self._drained = [0.0] * num_workers  # tokens of released reservations, per worker, ever
        self._down: set[int] = set()
        self._last_seq: dict[int, int] = {}
        self._lru_model = [OrderedDict() for _ in range(num_workers)]
        self._lru_used = [0] * num_workers

    # ---- cache view: queries ------------------------------------------------------------------
    def holders(self, kind: CacheKind, key: str, now: float) -> dict[int, HolderRecord]:
        """Live holders of ``key``; expired unconfirmed records are dropped on the way."""
        records = self._holders[kind].get(key)
        if not records:
            return {}
        dead = [w for w, r in records.items() if not r.alive(now)]
        for worker in dead:
            self._remove(kind, key, worker)
        return self._holders[kind].get(key, {})

    def prefix_matches(self, pc_keys: Iterable[str], now: float) -> dict[int, int]:
        """For each worker with any match: how many leading segments its device prefix cache covers (the
        planner moves a prefix hit as device KV; a home still finds its own lower-tier copies)."""
        matched: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, key in enumerate(pc_keys, start=1):
            here = {w for w, r in self.holders(CacheKind.PC, key, now).items() if r.tier is Tier.DEVICE}
            alive = set(here) if alive is None else alive & here
            if not alive:
                break
            for worker in alive:
                matched[worker] = depth
        return matched

    def wait_tokens(self, record: HolderRecord, worker: int) -> float:
        """How much of ``worker``'s queue a reader of ``record`` waits for, in prefill tokens: 0 once the copy is
        stored (confirmed); while it is only expected (recorded on dispatch), the work queued at ``worker`` before
        it and the task computing it, as counted at dispatch less what has drained since (the engine runs a
        worker's work in arrival order), and never more than the worker's whole queue now."""
        if record.confirmed:
            return 0.0
        return min(self.outstanding_tokens(worker), max(0.0, record.ready_mark - self._drained[worker]))

    # ---- load view ----------------------------------------------------------------------------
    def outstanding_tokens(self, worker: int) -> float:
        return math.inf if worker in self._down else self._outstanding[worker]

    def outstanding(self) -> list[float]:
        return [self.outstanding_tokens(w) for w in range(self.num_workers)]

    def set_down(self, worker: int, down: bool) -> None:
        """Mark ``worker`` dead (silent) or back; its reservations are kept apart and count again once it is back."""
        if down:
            self._down.add(worker)
        else:
            self._down.discard(worker)

    def reserve(self, task_id: str, worker: int, tokens: float) -> None:
        if task_id in self._reservations:
            raise ValueError(f"task {task_id!r} already holds a reservation")
        self._reservations[task_id] = (worker, tokens)
        self._outstanding[worker] += tokens

    def forget_worker(self, worker: int) -> None:
        """``worker`` is gone (or restarted): drop every record of what it held, and accept its event
        numbering afresh (a restarted worker counts from 1 again)."""
        for kind, by_key in self._holders.items():
            for key in [k for k, records in by_key.items() if worker in records]:
                self._remove(kind, key, worker)
        self._last_seq.pop(worker, None)

    def release(self, task_id: str) -> bool:
        """Free a task's reservation; False (and nothing changes) if it was already released."""
        reservation = self._reservations.pop(task_id, None)
        if reservation is None:
            return False
        worker, tokens = reservation
        self._outstanding[worker] = max(0.0, self._outstanding[worker] - tokens)
        self._drained[worker] += tokens
        return True

    # ---- optimistic accounting ----------------------------------------------------------------
    def record_dispatch(self, plan: PrefillPlan, now: float) -> None:
        """Reserve the plan's compute and, if configured, record where its KV will appear."""
        for seg in plan.segments:
            if seg.action is Action.COMPUTE:
                self.reserve(seg.task_id, seg.worker, seg.num_tokens)
            if self.config.record_on_dispatch and seg.action is not Action.LOCAL:
                self._expect(CacheKind.PIC, seg.key, seg.worker, seg.num_tokens, now)
        if plan.lead is not None:
            self.reserve(plan.lead.task_id, plan.lead.worker, plan.lead.num_tokens)
        self.reserve(plan.combine_task_id, plan.combine_home, plan.combine_tokens)
        if self.config.record_on_dispatch:
            for key, tokens in zip(plan.pc_keys, plan.segment_tokens):
                self._expect(CacheKind.PC, key, plan.combine_home, tokens, now)

    def _expect(self, kind: CacheKind, key: str, worker: int, tokens: int, now: float) -> None:
        records = self._holders[kind].setdefault(key, {})
        record = records.get(worker)
        if record is not None and record.alive(now):
            self._touch_model(kind, key, worker, tokens)
            return
        ttl = self.config.unconfirmed_ttl_s
        expires = float("inf") if ttl is None else now + ttl
        ready_mark = self._drained[worker] + self._outstanding[worker]
        self._add(kind, key, worker, HolderRecord(tokens, Tier.DEVICE, False, expires, ready_mark))
        if ttl is not None:
            heapq.heappush(self._expiry_heap, (expires, kind.value, key, worker))
        self._touch_model(kind, key, worker, tokens)

    def expire(self, now: float) -> int:
        """Drop unconfirmed records whose TTL has passed; returns how many were dropped."""
        dropped = 0
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            expires, kind_value, key, worker = heapq.heappop(self._expiry_heap)
            kind = CacheKind(kind_value)
            record = self._holders[kind].get(key, {}).get(worker)
            if record is not None and not record.confirmed and record.expires_at == expires:
                self._remove(kind, key, worker)
                dropped += 1
        return dropped

    # ---- worker events ------------------------------------------------------------------------
    def apply(self, event: WorkerEvent, now: float) -> bool:
        """Apply one worker event; False for a duplicate (sequence number already seen).

        Events of one worker must arrive in sequence order (one ordered channel per worker).
        """
        if event.seq <= self._last_seq.get(event.worker, -1):
            return False
        self._last_seq[event.worker] = event.seq
        if isinstance(event, DoneEvent):
            self.release(event.task_id)
        elif self.config.apply_cache_events:
            self._apply_cache_event(event)
        return True

    def _apply_cache_event(self, event: CacheEvent) -> None:
        num_tokens = tokens_per_key(event)
        for key in event.keys:
            if isinstance(event, StoreEvent):
                self._confirm(event.kind, key, event.worker, event.tier, num_tokens)
            elif isinstance(event, EvictEvent):
                self._drop(event.kind, key, event.worker, event.tier)
            elif isinstance(event, MoveEvent):
                self._drop(event.kind, key, event.worker, event.src)
                self._confirm(event.kind, key, event.worker, event.dst, num_tokens)

    def _drop(self, kind: CacheKind, key: str, worker: int, tier: Tier) -> None:
        record = self._holders[kind].get(key, {}).get(worker)
        if record is not None and record.tier is tier:
            self._remove(kind, key, worker)

    def _confirm(self, kind: CacheKind, key: str, worker: int, tier: Tier, num_tokens: int) -> None:
        record = self._holders[kind].get(key, {}).get(worker)
        if record is None:  # a late store re-registers a location the TTL already dropped
            self._add(kind, key, worker, HolderRecord(num_tokens, tier, True, float("inf")))
            return
        if record.tier is tier:  # the common case: an expected device copy confirmed
            record.confirmed, record.num_tokens = True, num_tokens
            return
        before = self._tiers(kind, key)
        record.confirmed, record.tier, record.num_tokens = True, tier, num_tokens
        self._announce(kind, key, before, record.num_tokens)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _tiers(self, kind: CacheKind, key: str) -> set[Tier]:
        return {record.tier for record in self._holders[kind].get(key, {}).values()}

    def _announce(self, kind: CacheKind, key: str, before: set[Tier], num_tokens: int) -> None:
        """Tell the listener which tiers ``key`` left or reached since ``before``."""
        if self._listener is None:
            return
        after = self._tiers(kind, key)
        for tier in before - after:
            self._listener(kind, key, tier, False, num_tokens)
        for tier in after - before:
            self._listener(kind, key, tier, True, num_tokens)

    def _add(self, kind: CacheKind, key: str, worker: int, record: HolderRecord) -> None:
        records = self._holders[kind].setdefault(key, {})
        if worker in records:  # a replaced record may take its tier away: compare the whole sets
            before = self._tiers(kind, key)
            records[worker] = record
            self._announce(kind, key, before, record.num_tokens)
            return
        first_here = self._listener is not None and all(r.tier is not record.tier for r in records.values())
        records[worker] = record
        if first_here:
            self._listener(kind, key, record.tier, True, record.num_tokens)

    def _remove(self, kind: CacheKind, key: str, worker: int) -> None:
        model = self._lru_model[worker]
        if (kind, key) in model:
            self._lru_used[worker] -= model.pop((kind, key))
        records = self._holders[kind].get(key)
        if not records or worker not in records:
            return
        record = records.pop(worker)
        if not records:
            del self._holders[kind][key]
        if self._listener is not None and all(r.tier is not record.tier for r in records.values()):
            self._listener(kind, key, record.tier, False, record.num_tokens)

    def _touch_model(self, kind: CacheKind, key: str, worker: int, tokens: int) -> None:
        """The optimistic strawman's guess of worker eviction: plain LRU over a known capacity."""
        capacity = self.config.modelled_capacity_tokens
        if capacity is None:
            return
        model = self._lru_model[worker]
        if (kind, key) in model:
            model.move_to_end((kind, key))
            return
        model[(kind, key)] = tokens
        self._lru_used[worker] += tokens
        while self._lru_used[worker] > capacity and len(model) > 1:
            old_kind, old_key = next(iter(model))
            self._remove(old_kind, old_key, worker)

    def touch(self, kind: CacheKind, key: str, worker: int) -> None:
        """A plan reuses ``key`` on ``worker``: refresh its modelled recency (strawman only)."""
        model = self._lru_model[worker]
        if (kind, key) in model:
            model.move_to_end((kind, key))

    # ---- failover -----------------------------------------------------------------------------
    def snapshot(self) -> ViewSnapshot:
        entries = tuple((kind.value, key, w, r.num_tokens, r.tier.value, r.confirmed, r.expires_at)
                        for kind, table in self._holders.items()
                        for key, records in table.items() for w, r in records.items())
        return ViewSnapshot(entries=entries,
                            reservations=tuple((t, w, n) for t, (w, n) in self._reservations.items()),
                            last_seq=tuple(sorted(self._last_seq.items())))

    def install(self, snapshot: ViewSnapshot) -> None:
        """Replace this view's state with ``snapshot`` (a new leader rebuilding its view)."""
        self._holders = {k: {} for k in CacheKind}
        self._expiry_heap, self._reservations = [], {}
        self._outstanding = [0.0] * self.num_workers
        self._drained = [0.0] * self.num_workers  # a snapshot's expected copies wait for their holder's whole queue
        self._lru_model = [OrderedDict() for _ in range(self.num_workers)]
        self._lru_used = [0] * self.num_workers
        for kind_value, key, worker, tokens, tier, confirmed, expires in snapshot.entries:
            kind = CacheKind(kind_value)
            self._add(kind, key, worker, HolderRecord(tokens, Tier(tier), confirmed, expires))
            if not confirmed and expires != float("inf"):
                heapq.heappush(self._expiry_heap, (expires, kind_value, key, worker))
        for task_id, worker, tokens in snapshot.reservations:
            self.reserve(task_id, worker, tokens)
        self._last_seq = dict(snapshot.last_seq)
