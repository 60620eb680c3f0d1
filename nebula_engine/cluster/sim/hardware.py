"""The simulator's shared hardware: processors that forwards share, and links that transfers queue on.

Pure bookkeeping over times the simulator passes in; it schedules its own completions through the
``at(time, action)`` callback the simulator gives it.
"""

from __future__ import annotations

from typing import Callable

from nebula_engine.cluster.control.config import ClusterProfile, TransferLink

Schedule = Callable[[float, Callable[[float], None]], None]
EPSILON_S = 1e-12


class SharedProcessor:
    """Forwards of the workers of one compute domain share its ``capacity`` equally (processor sharing).

    A GPU worker is its own domain of capacity 1, so its forward runs at full speed. On a CPU machine every
    worker is in one domain of ``node_cores``: k concurrent forwards each progress at node_cores / k times the
    single-core speed their times are given in (``ClusterProfile.shared_compute``).
    """

    def __init__(self, at: Schedule, capacity: float = 1.0):
        self._at = at
        self._capacity = capacity
        self._active: dict[int, list] = {}  # worker -> [full-speed seconds left, on_done]
        self._last = 0.0
        self._version = 0

    def start(self, worker: int, seconds: float, on_done: Callable[[float], None], now: float) -> None:
        if worker in self._active:
            raise RuntimeError(f"worker {worker} already runs a forward")
        self._advance(now)
        self._active[worker] = [seconds, on_done]
        self._reschedule(now)

    def _advance(self, now: float) -> None:
        if self._active:
            progress = (now - self._last) * self._capacity / len(self._active)
            for entry in self._active.values():
                entry[0] -= progress
        self._last = now

    def _reschedule(self, now: float) -> None:
        self._version += 1
        if not self._active:
            return
        version, left = self._version, min(entry[0] for entry in self._active.values())
        self._at(now + max(left, 0.0) * len(self._active) / self._capacity, lambda t: self._finish(t, version))

    def _finish(self, now: float, version: int) -> None:
        if version != self._version:
            return  # the set of running forwards changed since this completion was scheduled
        self._advance(now)
        done = [w for w, (left, _) in self._active.items() if left <= EPSILON_S]
        callbacks = [self._active.pop(w)[1] for w in done]
        self._reschedule(now)
        for callback in callbacks:
            callback(now)


def make_processors(profile: ClusterProfile, num_workers: int, at: Schedule) -> list[SharedProcessor]:
    """One processor per worker, or one shared by every worker of a node when ``shared_compute``."""
    if not profile.shared_compute:
        return [SharedProcessor(at) for _ in range(num_workers)]
    by_node: dict[int, SharedProcessor] = {}
    return [by_node.setdefault(profile.node_of(w), SharedProcessor(at, profile.node_cores)) for w in range(num_workers)]


class Links:
    """Transfers queue FIFO on the ports they use: a transfer from ``src`` to ``dst`` holds ``src``'s send
    port and ``dst``'s receive port of its link class (NVLink inside a node, the NIC between nodes) for
    latency + bytes / bandwidth; a read from a slower tier holds the worker's host-to-device port. So
    transfers through one port share its bandwidth one after another instead of running for free."""

    def __init__(self, profile: ClusterProfile):
        self.profile = profile
        self._free_at: dict[tuple, float] = {}

    def transfer(self, src: int, dst: int, num_bytes: float, now: float) -> float:
        """Start time ``now`` at the earliest; returns when the bytes are at ``dst``."""
        link = self.profile.link(src, dst)
        if link is None or num_bytes <= 0:
            return now
        kind = "nvlink" if link is self.profile.intra_node else "nic"
        return self._occupy([("send", kind, src), ("recv", kind, dst)], link, num_bytes, now)

    def load(self, worker: int, link: TransferLink | None, num_bytes: float, now: float) -> float:
        """Read ``num_bytes`` from a lower tier into ``worker``'s device; returns when they are there."""
        if link is None or num_bytes <= 0:
            return now
        return self._occupy([("load", worker)], link, num_bytes, now)

    def _occupy(self, ports: list[tuple], link: TransferLink, num_bytes: float, now: float) -> float:
        start = max([now] + [self._free_at.get(port, 0.0) for port in ports])
        end = start + link.seconds(num_bytes)
        for port in ports:
            self._free_at[port] = end
        return end
