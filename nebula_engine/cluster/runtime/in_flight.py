"""What is in flight on one worker, shared by its parts on the event loop: the store keys it is computing (a peer's
pin may wait for them), the requests it is serving (an abort cancels them), and whether a peer may be reading its
pages (its transfer agent progresses fast only then)."""

from __future__ import annotations

import asyncio

from nebula_engine.cluster.control.request_keys import token_content_id


def lead_key(token_ids: list[int]) -> str:
    """What a worker tracks a lead it prefills for another peer by (``InFlightKeys``), apart from PIC keys."""
    return "lead/" + token_content_id(token_ids)


class InFlightKeys:
    """Keys (PIC keys, ``lead_key``s) that tasks here are computing, each counted once per task."""

    def __init__(self):
        self._appeared: dict[str, asyncio.Event] = {}  # key -> set when the tasks computing it here are done
        self._computing: dict[str, int] = {}  # key -> tasks (scatter, lead or combine) computing it here

    def __contains__(self, key: str) -> bool:
        return key in self._computing

    def start(self, keys: list[str]) -> None:
        for key in keys:
            self._computing[key] = self._computing.get(key, 0) + 1
            if key not in self._appeared or self._appeared[key].is_set():
                self._appeared[key] = asyncio.Event()

    def stop(self, keys: list[str]) -> None:
        for key in keys:
            count = self._computing.get(key, 0) - 1
            if count > 0:
                self._computing[key] = count
                continue
            self._computing.pop(key, None)
            event = self._appeared.get(key)
            if event is not None:
                event.set()

    async def wait_done(self, key: str, timeout: float) -> bool:
        """Wait up to ``timeout`` for the tasks computing ``key`` here to end; False when they did not in time."""
        if key not in self._computing:
            return True
        try:
            await asyncio.wait_for(self._appeared[key].wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Streams:
    """The task serving each request here (a combine or a decode), by request id."""

    def __init__(self):
        self._tasks: dict[str, asyncio.Task] = {}

    def serving(self, request_id: str) -> None:
        """The current task serves ``request_id`` until ``done``."""
        self._tasks[request_id] = asyncio.current_task()

    def done(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()


class ReadsExpected:
    """Tells the transfer agent whether a peer may be reading this worker's pages: while any holder (pins held for
    readers, hand-offs waiting for their decode peer) says so. Idle from the start."""

    def __init__(self, agent):
        self.agent = agent
        self._active: set[str] = set()
        self._tell()

    def set(self, holder: str, active: bool) -> None:
        (self._active.add if active else self._active.discard)(holder)
        self._tell()

    def _tell(self) -> None:
        if self.agent is not None:
            self.agent.serve_reads(bool(self._active))
