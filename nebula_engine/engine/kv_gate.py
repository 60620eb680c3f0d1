"""A gate that holds a queued request back until the KV it waits for has arrived.

A cluster worker queues a combine as soon as it is planned, while the KV of its remote segments (and the
segments it prefills for itself) is still on its way, so that waiting for that KV overlaps the engine's queue
instead of adding to it (vLLM's remote-KV waiting state). The scheduler passes a request whose gate is shut, and
the request keeps its place in the queue. Each named part is opened once, from any thread; the gate opens with
the last one.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable


class KVGate:
    def __init__(self, parts: Iterable[str]):
        self._pending = set(parts)
        self._lock = threading.Lock()
        self.on_open: Callable[[], None] | None = None  # the engine's wake-up, set when the request is queued

    @property
    def is_open(self) -> bool:
        return not self._pending

    def open(self, part: str) -> None:
        """``part`` has arrived (again: no effect); the last one opens the gate and wakes the engine."""
        with self._lock:
            if part not in self._pending:
                return
            self._pending.discard(part)
            opened = not self._pending
        if opened and self.on_open is not None:
            self.on_open()
