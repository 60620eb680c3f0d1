"""Which peers are alive, as one peer sees it: every peer heartbeats every other, and any authenticated message
counts as a sign of life. A peer silent for ``dead_after_s`` is dead until it is heard from again (a restart).

The front end uses it to notice that the peer streaming a request died, a prefill peer to stop waiting for a
decode peer that will never take its hand-off; both act within ``dead_after_s`` of the last sign of life.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

DEFAULT_DEAD_AFTER_S = 3.0  # ten missed heartbeats (HEARTBEAT_S); what the router has used since the cluster ran
HEARTBEAT_S = 0.3
# How long a request may wait for a live leader after losing its peer before it fails with a 503: at most 10 s.
DEFAULT_FAILOVER_TIMEOUT_S = 10.0


class Liveness:
    def __init__(self, self_name: str, peers: Iterable[str], dead_after_s: float = DEFAULT_DEAD_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        if dead_after_s <= 0:
            raise ValueError(f"a peer timeout must be positive, got {dead_after_s}")
        self.self_name = self_name
        self.dead_after_s = dead_after_s
        self.clock = clock
        now = clock()
        self._last_heard = {peer: now for peer in peers if peer != self_name}  # started together: a grace period

    def heard(self, peer: str) -> None:
        if peer != self.self_name:
            self._last_heard[peer] = self.clock()

    def last_heard(self, peer: str) -> float:
        return self.clock() if peer == self.self_name else self._last_heard.get(peer, float("-inf"))

    def alive(self, peer: str) -> bool:
        return self.clock() - self.last_heard(peer) <= self.dead_after_s

    async def wait_dead(self, peer: str) -> None:
        """Returns once ``peer`` has been silent for ``dead_after_s`` (never for this peer itself)."""
        if peer == self.self_name:
            await asyncio.Event().wait()
        while (remaining := self.last_heard(peer) + self.dead_after_s - self.clock()) >= 0:
            await asyncio.sleep(remaining + 0.01)
