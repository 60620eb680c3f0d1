"""Tiers below the device pool: host memory, then local disk, each with a token capacity.

An entry evicted from the device is demoted to the host tier (or the disk when there is no host
tier); host overflow demotes its least recently used entries to disk; disk overflow drops them.
With ``demote_on_evict=False`` every eviction drops. A hit on a lower tier is promoted: the entry
leaves that tier and the caller writes it back into device pages. Every move is an event.

Payloads are opaque to this module: whatever the device side reads out of its pages (tensors) and
any per-backend state, serialized only when written to disk.

Capacities count an entry's ``charge``: its tokens, plus the pages of any state it carries (a hybrid model's
linear-attention state, HYPIC's transition maps) at a page's tokens each, so states take tier room by size.
Events keep reporting the entry's tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from nebula_engine.kvcache.disk_tier import DiskTier
from nebula_engine.kvcache.events import CacheKind, EventLog, Tier


@dataclass(frozen=True)
class TierConfig:
    host_capacity_tokens: int = 0  # 0: no host tier
    disk_capacity_tokens: int = 0  # 0: no disk tier
    disk_path: str | None = None  # directory of the disk tier; reused across restarts
    demote_on_evict: bool = True  # False: eviction from any tier drops the entry

    def __post_init__(self) -> None:
        if self.disk_capacity_tokens and not self.disk_path:
            raise ValueError("a disk tier needs disk_path")


class HostTier:
    """Payloads in host memory, least recently used first."""

    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._entries: OrderedDict[tuple[CacheKind, str], tuple[int, int, Any]] = OrderedDict()

    def __contains__(self, ident: tuple[CacheKind, str]) -> bool:
        return ident in self._entries

    def items(self):
        return [(ident, tokens) for ident, (tokens, _, _) in self._entries.items()]

    def put(self, ident: tuple[CacheKind, str], num_tokens: int, payload: Any, charge: int) -> None:
        self._entries[ident] = (num_tokens, charge, payload)
        self.used_tokens += charge

    def pop(self, ident: tuple[CacheKind, str]) -> tuple[int, Any, int]:
        """(tokens, payload, charge) of the entry, removed."""
        num_tokens, charge, payload = self._entries.pop(ident)
        self.used_tokens -= charge
        return num_tokens, payload, charge

    def oldest(self) -> tuple[CacheKind, str]:
        return next(iter(self._entries))


class TierChain:
    def __init__(self, config: TierConfig, events: EventLog):
        self.config = config
        self.events = events
        self.host = HostTier(config.host_capacity_tokens) if config.host_capacity_tokens else None
        self.disk = DiskTier(config.disk_path, config.disk_capacity_tokens) if config.disk_capacity_tokens else None
        self.promoted_tokens: Counter[tuple[CacheKind, Tier]] = Counter()  # tokens brought back to the device
        for entry in self.disk.entries() if self.disk else ():  # persisted by an earlier process
            self.events.store(CacheKind(entry.kind), (entry.key,), entry.num_tokens, Tier.DISK)

    def tier_of(self, kind: CacheKind, key: str) -> Tier | None:
        if self.host is not None and (kind, key) in self.host:
            return Tier.HOST
        if self.disk is not None and (kind.value, key) in self.disk:
            return Tier.DISK
        return None

    def demote(self, kind: CacheKind, key: str, num_tokens: int, payload: Any, charge: int | None = None) -> bool:
        """Take an entry leaving the device; False when it is dropped instead (nothing emitted).
        ``charge``: the capacity it takes (default: its tokens)."""
        if not self.config.demote_on_evict:
            return False
        charge = num_tokens if charge is None else charge
        if self.host is not None and charge <= self.host.capacity_tokens:
            self.events.move(kind, (key,), num_tokens, Tier.DEVICE, Tier.HOST)
            self.host.put((kind, key), num_tokens, payload, charge)
            self._shrink_host()
            return True
        return self._to_disk(kind, key, num_tokens, payload, Tier.DEVICE, charge)

    def _to_disk(self, kind: CacheKind, key: str, num_tokens: int, payload: Any, src: Tier, charge: int) -> bool:
        if self.disk is None or charge > self.disk.capacity_tokens:
            return False
        self.events.move(kind, (key,), num_tokens, src, Tier.DISK)
        self.disk.put(kind.value, key, num_tokens, payload, charge)
        while self.disk.used_tokens > self.disk.capacity_tokens:
            oldest = self.disk.entries()[0]
            self.disk.remove(oldest.kind, oldest.key)
            self.events.evict(CacheKind(oldest.kind), (oldest.key,), oldest.num_tokens, Tier.DISK)
        return True

    def _shrink_host(self) -> None:
        while self.host.used_tokens > self.host.capacity_tokens:
            kind, key = self.host.oldest()
            num_tokens, payload, charge = self.host.pop((kind, key))
            if not self._to_disk(kind, key, num_tokens, payload, Tier.HOST, charge):
                self.events.evict(kind, (key,), num_tokens, Tier.HOST)

    def discard(self, kind: CacheKind, key: str) -> None:
        """Drop a lower copy of ``key`` (the device now holds a fresh one)."""
        tier = self.tier_of(kind, key)
        if tier is Tier.HOST:
            num_tokens, _, _ = self.host.pop((kind, key))
        elif tier is Tier.DISK:
            num_tokens = self._disk_tokens(kind, key)
            self.disk.remove(kind.value, key)
        else:
            return
        self.events.evict(kind, (key,), num_tokens, tier)

    def _disk_tokens(self, kind: CacheKind, key: str) -> int:
        return next(e.num_tokens for e in self.disk.entries() if (e.kind, e.key) == (kind.value, key))

    def prefetch(self, kind: CacheKind, key: str) -> Future | None:
        """Start loading a disk entry in the background; None unless it is on disk."""
        if self.disk is None:
            return None
        return self.disk.prefetch(kind.value, key)

    def promote(self, kind: CacheKind, key: str) -> Any | None:
        """Remove the entry from its tier and return its payload for the device; None on a miss.

        A disk entry that fails verification is dropped (an evict event) and is a miss.
        """
        tier = self.tier_of(kind, key)
        if tier is Tier.HOST:
            num_tokens, payload, _ = self.host.pop((kind, key))
            self.events.move(kind, (key,), num_tokens, Tier.HOST, Tier.DEVICE)
            self.promoted_tokens[kind, Tier.HOST] += num_tokens
            return payload
        if tier is Tier.DISK:
            num_tokens = self._disk_tokens(kind, key)
            payload = self.disk.get(kind.value, key)
            if payload is None:
                self.events.evict(kind, (key,), num_tokens, Tier.DISK)
                return None
            self.disk.remove(kind.value, key)
            self.events.move(kind, (key,), num_tokens, Tier.DISK, Tier.DEVICE)
            self.promoted_tokens[kind, Tier.DISK] += num_tokens
            return payload
        return None

    def entries(self) -> list[tuple[CacheKind, str, Tier, int]]:
        held = [(kind, key, Tier.HOST, tokens) for (kind, key), tokens in (self.host.items() if self.host else ())]
        disk = self.disk.entries() if self.disk else ()
        held += [(CacheKind(e.kind), e.key, Tier.DISK, e.num_tokens) for e in disk]
        return held

    def flush(self) -> None:
        """Wait for background disk I/O (writes, removals, index updates)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
