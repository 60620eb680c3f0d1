"""A worker's KV store as the simulator models it: PC and PIC entries sharing one token budget.

Eviction (DESIGN §4, paper eq. 2): ``soft-share`` evicts PC first while PC occupancy exceeds
p * (PC + PIC), else PIC; ``unified-lru`` evicts the least recent entry of either type;
``fixed-partition`` gives each type a hard share p of the budget, no borrowing. LRU within a type.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from nebula_engine.cluster.messages import CacheKind

EVICTION_RULES = ("soft-share", "unified-lru", "fixed-partition")


class WorkerCache:
    """Invariant after every ``store`` / ``pin``: cached + pinned tokens <= capacity, as far as
    evicting cached entries allows. ``pinned`` is KV of running jobs: it shares the pool (an entry
    larger than what is left is stored and immediately evicted)."""

    def __init__(self, capacity_tokens: int, eviction: str = "soft-share", pc_share: float = 0.5):
        if eviction not in EVICTION_RULES:
            raise ValueError(f"unknown eviction rule {eviction!r}; choose from {EVICTION_RULES}")
        self.capacity = capacity_tokens
        self.eviction = eviction
        self.pc_share = pc_share
        self.entries = {kind: OrderedDict() for kind in CacheKind}  # key -> (tokens, stamp)
        self.used = {kind: 0 for kind in CacheKind}
        self.pinned = 0
        self._clock = itertools.count()

    def has(self, kind: CacheKind, key: str) -> bool:
        return key in self.entries[kind]

    def touch(self, kind: CacheKind, key: str) -> None:
        entries = self.entries[kind]
        if key in entries:
            entries[key] = (entries[key][0], next(self._clock))
            entries.move_to_end(key)

    def store(self, kind: CacheKind, key: str, tokens: int) -> tuple[bool, list[tuple[CacheKind, str]]]:
        """Insert (or refresh) an entry; returns (newly stored?, evicted entries in order)."""
        if key in self.entries[kind]:
            self.touch(kind, key)
            return False, []
        self.entries[kind][key] = (tokens, next(self._clock))
        self.used[kind] += tokens
        return True, self._make_room(kind)

    def pin(self, tokens: int) -> list[tuple[CacheKind, str]]:
        """A job starts and holds ``tokens`` of the pool; returns the cached entries evicted for it."""
        self.pinned += tokens
        return self._make_room(None)

    def unpin(self, tokens: int) -> None:
        self.pinned -= tokens

    def _make_room(self, inserted: CacheKind | None) -> list[tuple[CacheKind, str]]:
        evicted = []
        while self._over_budget(inserted) and (self.entries[CacheKind.PC] or self.entries[CacheKind.PIC]):
            kind = self._victim_kind(inserted)
            key, (tokens, _) = self.entries[kind].popitem(last=False)
            self.used[kind] -= tokens
            evicted.append((kind, key))
        return evicted

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
