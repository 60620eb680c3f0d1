"""``CacheLock``: who may touch one engine's KV cache (pool, PIC store, prefix tree, tiers) when.

The engine thread holds it for a whole step except the model's forward passes over already scheduled pages
(``released``). Another thread that takes it (a cluster peer pinning a segment for a reader, or storing one it
read) therefore gets in while the engine computes, instead of waiting for the step to end; what it finds is
never half-changed, and the pages the forward reads and writes belong to running requests (or to the PIC
executor, until it stores them), which no cache operation frees or evicts. Called by a thread that does not hold
the lock (offline prefill driving the PIC executor directly), ``released`` does nothing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class CacheLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> CacheLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc_info) -> None:
        self._owner = None
        self._lock.release()

    def held(self) -> bool:
        """Whether the calling thread holds it."""
        return self._owner == threading.get_ident()

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let other threads in for the body, if the calling thread holds the lock; it holds it again after."""
        if not self.held():
            yield
            return
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()
