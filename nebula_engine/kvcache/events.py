"""Cache events: the one type in which a KV cache's changes reach the cluster's view, and the index they describe.

Every store, evict and tier move of a cached entry becomes one event, numbered by a per-worker
sequence that increases by one per event. Replaying a worker's events in order on an empty
``CacheIndex`` reproduces that worker's index exactly (its ``snapshot()``). The same types travel
unchanged to the router (``cluster.runtime.wire`` carries them, msgspec-encoded) and into the control
plane's view, which is how a router keeps a view without ever touching KV bytes; on the way a cluster
worker renumbers them in its own sequence (shared with its task reports) and reports prefix-cache
entries per prompt segment instead of per page (``cluster.runtime.worker``).

This module stays light (no torch) so that the control plane and the simulator can import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec


class CacheKind(str, enum.Enum):
    PC = "pc"  # prefix-chain entry: valid only after exactly the same preceding tokens
    PIC = "pic"  # position-independent segment: keyed by its content alone


class Tier(str, enum.Enum):
    """Where a worker holds a copy, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class _Event(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """What every cache event says: whose, its number, and which entries (tagged by subclass on the wire)."""

    worker: int
    seq: int
    kind: CacheKind
    keys: tuple[str, ...]
    num_tokens: int


class StoreEvent(_Event):
    """``worker`` now holds ``keys`` on ``tier``.

    A PC event lists consecutive pages of one chain, each key covering one full page
    (``num_tokens // len(keys)`` tokens); ``parent_key`` is the chain's key before ``keys[0]``
    (None at the root). A PIC event carries exactly one key. A cluster reports its prefix caches per
    prompt segment instead: one key per event, naming the prompt's prefix through that segment.
    """

    tier: Tier = Tier.DEVICE
    parent_key: str | None = None


class EvictEvent(_Event):
    """``keys`` are dropped from ``tier`` (and from the worker: a demotion is a ``MoveEvent``)."""

    tier: Tier = Tier.DEVICE


class MoveEvent(_Event):
    """``keys`` moved from tier ``src`` to tier ``dst`` (demotion or promotion)."""

    src: Tier
    dst: Tier


CacheEvent = StoreEvent | EvictEvent | MoveEvent


def tokens_per_key(event: CacheEvent) -> int:
    """Tokens each of ``event.keys`` covers."""
    return event.num_tokens // len(event.keys) if event.keys else 0


class EventLog:
    """Assigns sequence numbers and buffers events until ``drain_events()``."""

    def __init__(self, worker: int):
        self.worker = worker
        self.last_seq = 0
        self._pending: list[CacheEvent] = []

    def _next(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def store(self, kind: CacheKind, keys: tuple[str, ...], num_tokens: int, tier: Tier = Tier.DEVICE,
              parent_key: str | None = None) -> None:
        self._pending.append(StoreEvent(self.worker, self._next(), kind, keys, num_tokens, tier, parent_key))

    def evict(self, kind: CacheKind, keys: tuple[str, ...], num_tokens: int, tier: Tier = Tier.DEVICE) -> None:
        self._pending.append(EvictEvent(self.worker, self._next(), kind, keys, num_tokens, tier))

    def move(self, kind: CacheKind, keys: tuple[str, ...], num_tokens: int, src: Tier, dst: Tier) -> None:
        self._pending.append(MoveEvent(self.worker, self._next(), kind, keys, num_tokens, src, dst))

    def drain_events(self) -> list[CacheEvent]:
        """Events since the previous drain, in sequence order."""
        events, self._pending = self._pending, []
        return events


@dataclass(frozen=True)
class IndexEntry:
    tier: Tier
    num_tokens: int


@dataclass
class CacheIndex:
    """``(kind, key) -> (tier, tokens)`` of one worker; built by ``apply`` or by a cache's snapshot."""

    worker: int
    last_seq: int = 0
    entries: dict[tuple[CacheKind, str], IndexEntry] = field(default_factory=dict)

    def apply(self, event: CacheEvent) -> None:
        """Replay one event; raises ValueError on a gap in ``seq`` or an event the index contradicts."""
        if event.worker != self.worker or event.seq != self.last_seq + 1:
            raise ValueError(f"event {event.seq} of worker {event.worker} does not follow {self.last_seq}")
        self.last_seq = event.seq
        per_key = tokens_per_key(event)
        for key in event.keys:
            self._apply_key(event, (event.kind, key), per_key)

    def _apply_key(self, event: CacheEvent, ident: tuple[CacheKind, str], num_tokens: int) -> None:
        current = self.entries.get(ident)
        if isinstance(event, StoreEvent):
            if current is not None:
                raise ValueError(f"store of {ident} already held on {current.tier}")
            self.entries[ident] = IndexEntry(event.tier, num_tokens)
            return
        expected = event.tier if isinstance(event, EvictEvent) else event.src
        if current is None or current.tier is not expected:
            raise ValueError(f"{type(event).__name__} of {ident} on {expected}, index has {current}")
        if isinstance(event, EvictEvent):
            del self.entries[ident]
        else:
            self.entries[ident] = IndexEntry(event.dst, current.num_tokens)

    def occupancy(self) -> dict[tuple[CacheKind, Tier], int]:
        """Tokens held per (kind, tier); every pair present, zero when empty."""
        counts = {(kind, tier): 0 for kind in CacheKind for tier in Tier}
        for (kind, _), entry in self.entries.items():
            counts[kind, entry.tier] += entry.num_tokens
        return counts
