"""PIC segment store: content-addressed KV of segments computed on their own.

The key is a stable hash of (model identity, PIC backend identity, segment token ids) and does not
depend on what precedes the segment. The value is the segment's device pages (it starts
page-aligned; its last page may be partial) plus opaque per-backend state blobs.

The tensors of a state (HYPIC's transition maps) are kept in pool pages of their own, ``state_pages``
(``page_blob``): they count against the same budget as K/V (one page's tokens each in the store's sizes),
leave with their segment and move through the tiers with it. ``entry.state`` reads them back.

Invariants: the store holds one ``PagePool`` reference on each page of each entry; an entry's pages
and state are only safe while the entry is locked; only unlocked entries are evicted, least
recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import xxhash

from nebula_engine.kvcache.events import CacheKind, EventLog
from nebula_engine.kvcache.pool import KVCacheError, PagePool


def segment_key(model_id: str, backend_id: str, token_ids: list[int]) -> str:
    """Stable across processes and machines (no Python ``hash``): same content, same key."""
    header = f"pic:{len(model_id)}:{model_id}:{len(backend_id)}:{backend_id}:".encode()
    return xxhash.xxh3_128_hexdigest(header + np.asarray(token_ids, dtype=np.int64).tobytes())


@dataclass(eq=False)
class PICEntry:
    key: str
    num_tokens: int
    pages: tuple[int, ...]
    # the per-backend state, never inspected here; with ``state_pages``, its tensors are ``TensorRef``s to them
    stored_state: Mapping[str, Any] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    state_pages: tuple[int, ...] = ()
    state_layouts: tuple = ()  # ``TensorLayout`` of each tensor kept in ``state_pages``
    read_state: Callable[[PICEntry], Mapping[str, Any]] | None = None  # set with ``state_pages``
    page_size: int = 0  # of the store's pool: sizes ``size``

    @property
    def state(self) -> Mapping[str, Any]:
        """The backend's state, its tensors read back from their pages (a private copy)."""
        return self.read_state(self) if self.state_pages else self.stored_state

    @property
    def size(self) -> int:
        """Tokens of pool memory: the segment's, plus a page's worth per state page."""
        return self.num_tokens + len(self.state_pages) * self.page_size


class PICStore:
    def __init__(self, pool: PagePool, page_size: int, events: EventLog, clock: Iterator[int],
                 demote: Callable[[PICEntry], bool] | None = None,
                 discard_lower: Callable[[CacheKind, str], None] | None = None):
        """``demote`` and ``discard_lower``: the lower tiers' hooks, as in ``RadixCache``."""
        self.pool = pool
        self.page_size = page_size
        self.events = events
        self._clock = clock
        self._entries: OrderedDict[str, PICEntry] = OrderedDict()  # least recently used first
        self.evictable_size = 0  # tokens of unlocked entries
        self.protected_size = 0
        self.num_evictable_pages = 0
        self.demote = demote
        self.discard_lower = discard_lower

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def entries(self) -> Iterator[PICEntry]:
        return iter(self._entries.values())

    def lookup(self, key: str) -> PICEntry | None:
        """The entry for ``key``, marked recently used; lock it before using its pages."""
        entry = self._entries.get(key)
        if entry is not None:
            self._touch(entry)
        return entry

    def insert(self, key: str, num_tokens: int, pages: list[int], state: Mapping[str, Any] | None = None,
               promoted: bool = False, state_pages: list[int] = (), state_layouts: tuple = (),
               read_state: Callable[[PICEntry], Mapping[str, Any]] | None = None) -> PICEntry:
        """Cache a segment's pages (the store takes its own reference); an existing key wins.

        ``state_pages``: pages keeping the tensors of ``state`` (of ``state_layouts``; ``state`` holds
        ``TensorRef``s to them), read back by ``read_state``; the store takes its reference on them too.
        ``promoted``: the segment came back from a lower tier, whose move event already says so.
        """
        if key in self._entries:
            return self.lookup(key)
        if len(pages) != -(-num_tokens // self.page_size) or num_tokens <= 0:
            raise KVCacheError(f"{len(pages)} pages cannot hold a segment of {num_tokens} tokens")
        if state_pages and read_state is None:
            raise KVCacheError("state pages need a reader")
        self.pool.share([*pages, *state_pages])
        entry = PICEntry(key, num_tokens, tuple(pages), dict(state or {}), state_pages=tuple(state_pages),
                         state_layouts=tuple(state_layouts), read_state=read_state, page_size=self.page_size)
        self._entries[key] = entry
        self._touch(entry)
        self.evictable_size += entry.size
        self.num_evictable_pages += len(pages) + len(state_pages)
        if not promoted:
            if self.discard_lower is not None:
                self.discard_lower(CacheKind.PIC, key)
            self.events.store(CacheKind.PIC, (key,), num_tokens)
        return entry

    def _touch(self, entry: PICEntry) -> None:
        entry.last_access = next(self._clock)
        self._entries.move_to_end(entry.key)

    def lock(self, entry: PICEntry) -> None:
        if entry.lock_ref == 0:
            self._move_size(entry, -1)
        entry.lock_ref += 1

    def unlock(self, entry: PICEntry) -> None:
        if entry.lock_ref <= 0:
            raise KVCacheError(f"unlock of unlocked PIC entry {entry.key}")
        entry.lock_ref -= 1
        if entry.lock_ref == 0:
            self._move_size(entry, +1)

    def _move_size(self, entry: PICEntry, sign: int) -> None:
        self.evictable_size += sign * entry.size
        self.protected_size -= sign * entry.size
        self.num_evictable_pages += sign * (len(entry.pages) + len(entry.state_pages))

    def _oldest_unlocked(self) -> PICEntry | None:
        return next((e for e in self._entries.values() if e.lock_ref == 0), None)

    def oldest_evictable(self) -> int | None:
        entry = self._oldest_unlocked()
        return None if entry is None else entry.last_access

    def evict_one(self) -> PICEntry | None:
        """Drop the least recently used unlocked entry and release its pages; None when none is left."""
        entry = self._oldest_unlocked()
        if entry is None:
            return None
        del self._entries[entry.key]
        self.evictable_size -= entry.size
        self.num_evictable_pages -= len(entry.pages) + len(entry.state_pages)
        if self.demote is None or not self.demote(entry):
            self.events.evict(CacheKind.PIC, (entry.key,), entry.num_tokens)
        self.pool.release([*entry.pages, *entry.state_pages])
        return entry

    def check_integrity(self) -> None:
        evictable = sum(e.size for e in self._entries.values() if e.lock_ref == 0)
        protected = sum(e.size for e in self._entries.values() if e.lock_ref > 0)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise KVCacheError(f"PIC sizes {(self.evictable_size, self.protected_size)} != {(evictable, protected)}")
        pages = [p for e in self._entries.values() for p in (*e.pages, *e.state_pages)]
        if len(set(pages)) != len(pages) or any(self.pool.ref_cnt[p] < 1 for p in pages):
            raise KVCacheError("a PIC page is held twice or not referenced")
