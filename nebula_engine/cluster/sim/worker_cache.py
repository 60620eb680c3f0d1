"""A worker's KV cache as the simulator models it: a device pool with a host tier below it.

Each tier holds PC and PIC entries in one token budget. Eviction (DESIGN §4, paper eq. 2) per tier:
``soft-share`` evicts PC first while PC occupancy exceeds p * (PC + PIC), else PIC; ``unified-lru`` evicts
the least recent entry of either type; ``fixed-partition`` gives each type a hard share p of the budget,
no borrowing. LRU within a type. As on the workers (``kvcache.tiers``), an entry evicted from the device
is demoted to the host tier when there is one, the host tier drops its overflow, a host hit is promoted
back to the device, and a fresh device copy replaces a lower one. Every change is reported as a
:class:`CacheChange`, which the simulator turns into the worker's cache event (``kvcache.events``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from nebula_engine.cluster.control.messages import CacheEvent, CacheKind, EvictEvent, MoveEvent, StoreEvent, Tier

EVICTION_RULES = ("soft-share", "unified-lru", "fixed-partition")


@dataclass(frozen=True)
class CacheChange:
    """``key`` moved from tier ``src`` to ``dst``; ``src`` None = newly stored, ``dst`` None = dropped."""

    kind: CacheKind
    key: str
    num_tokens: int
    src: Tier | None
    dst: Tier | None

    def event(self, worker: int, seq: int) -> CacheEvent:
        """This change as ``worker`` reports it: a store, an evict or a tier move, numbered ``seq``."""
        keys = (self.key,)
        if self.src is None:
            return StoreEvent(worker, seq, self.kind, keys, self.num_tokens, self.dst)
        if self.dst is None:
            return EvictEvent(worker, seq, self.kind, keys, self.num_tokens, self.src)
        return MoveEvent(worker, seq, self.kind, keys, self.num_tokens, self.src, self.dst)


class TierStore:
    """One tier's entries under one eviction rule. ``pinned`` tokens (running requests' KV) share the budget."""

    def __init__(self, tier: Tier, capacity_tokens: int, eviction: str, pc_share: float, clock):
        if eviction not in EVICTION_RULES:
            raise ValueError(f"unknown eviction rule {eviction!r}; choose from {EVICTION_RULES}")
        self.tier, self.capacity, self.eviction, self.pc_share = tier, capacity_tokens, eviction, pc_share
        self.entries = {kind: OrderedDict() for kind in CacheKind}  # key -> (tokens, stamp)
        self.used = {kind: 0 for kind in CacheKind}
        self.pinned = 0
        self._clock = clock

    def has(self, kind: CacheKind, key: str) -> bool:
        return key in self.entries[kind]

    def touch(self, kind: CacheKind, key: str) -> None:
        entries = self.entries[kind]
        if key in entries:
            entries[key] = (entries[key][0], next(self._clock))
            entries.move_to_end(key)

    def add(self, kind: CacheKind, key: str, tokens: int) -> None:
        self.entries[kind][key] = (tokens, next(self._clock))
        self.used[kind] += tokens

    def remove(self, kind: CacheKind, key: str) -> int:
        tokens, _ = self.entries[kind].pop(key)
        self.used[kind] -= tokens
        return tokens

    def next_victim(self, inserted: CacheKind | None) -> tuple[CacheKind, str, int] | None:
        """The entry to evict now (removed), or None when the tier is within budget or has nothing left."""
        if not self._over_budget(inserted) or not (self.entries[CacheKind.PC] or self.entries[CacheKind.PIC]):
            return None
        kind = self._victim_kind(inserted)
        key = next(iter(self.entries[kind]))
        return kind, key, self.remove(kind, key)

    def _over_budget(self, inserted: CacheKind | None) -> bool:
        total = self.used[CacheKind.PC] + self.used[CacheKind.PIC] + self.pinned
        if self.eviction == "fixed-partition" and inserted is not None:
            return total > self.capacity or self.used[inserted] > self._partition(inserted)
        return total > self.capacity

    def _partition(self, kind: CacheKind) -> float:
        share = self.pc_share if kind is CacheKind.PC else 1.0 - self.pc_share
        return share * self.capacity

    def _victim_kind(self, inserted: CacheKind | None) -> CacheKind:
        pc, pic = self.entries[CacheKind.PC], self.entries[CacheKind.PIC]
        if not pc or not pic:
            return CacheKind.PC if pc else CacheKind.PIC
        if self.eviction == "fixed-partition":
            if inserted is not None and self.used[inserted] > self._partition(inserted):
                return inserted
            over_pc = self.used[CacheKind.PC] / max(self._partition(CacheKind.PC), 1e-9)
            over_pic = self.used[CacheKind.PIC] / max(self._partition(CacheKind.PIC), 1e-9)
            return CacheKind.PC if over_pc >= over_pic else CacheKind.PIC
        if self.eviction == "unified-lru":
            oldest_pc, oldest_pic = next(iter(pc.values()))[1], next(iter(pic.values()))[1]
            return CacheKind.PC if oldest_pc < oldest_pic else CacheKind.PIC
        total = self.used[CacheKind.PC] + self.used[CacheKind.PIC]
        return CacheKind.PC if self.used[CacheKind.PC] > self.pc_share * total else CacheKind.PIC


class WorkerCache:
    """Device tier + optional host tier of one worker.

    Invariant after every call: each tier holds at most its capacity (device: cached + pinned), as far as
    evicting cached entries allows; a key is on at most one tier."""

    def __init__(self, capacity_tokens: int, eviction: str = "soft-share", pc_share: float = 0.5,
                 host_capacity_tokens: int = 0):
        clock = itertools.count()  # one clock for both types and tiers, so unified-lru can compare them
        self.device = TierStore(Tier.DEVICE, capacity_tokens, eviction, pc_share, clock)
        self.host = TierStore(Tier.HOST, host_capacity_tokens, eviction, pc_share, clock) \
            if host_capacity_tokens > 0 else None

    @property
    def used(self) -> dict[CacheKind, int]:
        return self.device.used

    def set_shares(self, shares: dict[Tier, float]) -> None:
        for store in (self.device, self.host):
            if store is not None and store.tier in shares:
                store.pc_share = shares[store.tier]

    def tier_of(self, kind: CacheKind, key: str) -> Tier | None:
        if self.device.has(kind, key):
            return Tier.DEVICE
        if self.host is not None and self.host.has(kind, key):
            return Tier.HOST
        return None

    def has(self, kind: CacheKind, key: str) -> bool:
        """On the device (usable without a load)."""
        return self.device.has(kind, key)

    def touch(self, kind: CacheKind, key: str) -> None:
        self.device.touch(kind, key)

    def store(self, kind: CacheKind, key: str, tokens: int) -> list[CacheChange]:
        """A fresh device copy of ``key`` (a refresh when already there; a lower copy is dropped)."""
        if self.device.has(kind, key):
            self.device.touch(kind, key)
            return []
        changes = []
        if self.host is not None and self.host.has(kind, key):
            changes.append(CacheChange(kind, key, self.host.remove(kind, key), Tier.HOST, None))
        self.device.add(kind, key, tokens)
        changes.append(CacheChange(kind, key, tokens, None, Tier.DEVICE))
        return changes + self._make_room(kind)

    def promote(self, kind: CacheKind, key: str) -> list[CacheChange]:
        """Move a host copy to the device (the caller pays the load)."""
        tokens = self.host.remove(kind, key)
        self.device.add(kind, key, tokens)
        return [CacheChange(kind, key, tokens, Tier.HOST, Tier.DEVICE)] + self._make_room(kind)

    def pin(self, tokens: int) -> list[CacheChange]:
        """A request starts and holds ``tokens`` of the device pool; returns what moved to make room."""
        self.device.pinned += tokens
        return self._make_room(None)

    def unpin(self, tokens: int) -> None:
        self.device.pinned -= tokens

    def _make_room(self, inserted: CacheKind | None) -> list[CacheChange]:
        changes = []
        while (victim := self.device.next_victim(inserted)) is not None:
            kind, key, tokens = victim
            if self.host is not None and tokens <= self.host.capacity:
                self.host.add(kind, key, tokens)
                changes.append(CacheChange(kind, key, tokens, Tier.DEVICE, Tier.HOST))
                changes += self._shrink_host(kind)
            else:
                changes.append(CacheChange(kind, key, tokens, Tier.DEVICE, None))
        return changes

    def _shrink_host(self, inserted: CacheKind) -> list[CacheChange]:
        changes = []
        while (victim := self.host.next_victim(inserted)) is not None:
            kind, key, tokens = victim
            changes.append(CacheChange(kind, key, tokens, Tier.HOST, None))
        return changes
