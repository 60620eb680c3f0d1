"""The data plane of one peer: executes the router's commands on this peer's engine and moves KV with NIXL.

``WorkerService`` only wires its parts, each given what it needs when it is built, and passes each message to the
part that handles it:

- ``PrefillTasks`` (``prefill_tasks``): the router's ``Scatter``, ``ScatterLead`` and ``Combine``.
- ``RemoteReads`` (``remote_reads``): this worker reading other peers' segments and prefixes (pin, NIXL read, store).
- ``PinServer`` (``pin_server``): other peers' pins of this worker's KV, held until they unpin.
- ``Handoffs`` (``handoff``): the prefill -> decode hand-off, both sides.
- ``CacheReporter`` (``cache_reporting``): cache events and task completions to the router, in one sequence.

They share what is in flight here (``in_flight``): keys being computed, requests being served, whether a peer may be
reading our pages. Messages are built from the engine's types in ``worker_codec``. The engine is reached only
through its two ports, ``KVPort`` (the KV cache) and ``RequestPort`` (requests), whose operations run on the
engine's own thread or under its cache lock; the worker's own state lives on the event loop.
"""

from __future__ import annotations

from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.cache_reporting import CacheCounts, CacheReporter
from nebula_engine.cluster.runtime.handoff import Handoffs
from nebula_engine.cluster.runtime.in_flight import InFlightKeys, ReadsExpected, Streams
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.pin_server import PinServer
from nebula_engine.cluster.runtime.prefill_tasks import PrefillTasks
from nebula_engine.cluster.runtime.remote_reads import RemoteReads
from nebula_engine.cluster.runtime.transfer import KVTransferAgent
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.request_port import RequestPort


class WorkerService:
    """``send``: the peer's one send path, to itself included (reports reach its own router while it leads);
    ``pic_key``: (wire spec, segment ids) -> store key, the same function the router plans with."""

    def __init__(self, name: str, role: str, worker_index: int, kv: KVPort, requests: RequestPort,
                 agent: KVTransferAgent, send: Callable[[str, wire.Msg], None], leader: Callable[[], str | None],
                 pic_key: Callable[[str | None, list[int]], str], liveness: Liveness):
        self.name, self.role, self.worker_index = name, role, worker_index
        in_flight, self.streams, reads_expected = InFlightKeys(), Streams(), ReadsExpected(agent)
        self.in_flight = in_flight
        self.reporter = CacheReporter(name, role, worker_index, kv, send, leader, pic_key)
        self.reads = RemoteReads(name, kv, agent, send, liveness)
        self.pins = PinServer(name, kv, send, in_flight, reads_expected)
        self.handoffs = Handoffs(name, kv, requests, send, liveness, self.reads, reads_expected, self.streams)
        self.prefill = PrefillTasks(name, kv, requests, send, liveness, pic_key, in_flight, self.streams, self.reads,
                                    self.handoffs, self.reporter)

    # ---- counters (status, metrics) ----
    @property
    def transfer_bytes(self) -> int:
        return self.reads.transfer_bytes

    @property
    def read_bytes(self) -> dict[str, int]:
        """KV bytes read from other peers, by what was read (prefix, pic, handoff)."""
        return dict(self.reads.read_bytes)

    @property
    def read_tokens(self) -> dict[str, int]:
        return dict(self.reads.read_tokens)

    @property
    def transfer_failures(self) -> int:
        return self.reads.transfer_failures

    @property
    def lead_tokens_prefilled(self) -> int:
        return self.prefill.lead_tokens_prefilled

    @property
    def leads_for_others(self) -> int:
        return self.prefill.leads_for_others

    @property
    def evictions(self) -> CacheCounts:
        return self.reporter.evictions

    # ---- router commands ----
    async def on_scatter(self, msg: wire.Scatter) -> None:
        await self.prefill.on_scatter(msg)

    async def on_scatter_lead(self, msg: wire.ScatterLead) -> None:
        await self.prefill.on_scatter_lead(msg)

    async def on_combine(self, msg: wire.Combine) -> None:
        await self.prefill.on_combine(msg)

    async def pump_events(self, snapshot: bool = False) -> None:
        await self.reporter.pump_events(snapshot)

    # ---- pins: as a reader, as a holder ----
    def on_pin_reply(self, msg: wire.PinReply) -> None:
        self.reads.on_pin_reply(msg)

    async def on_pin(self, msg: wire.PinSegment) -> None:
        await self.pins.on_pin(msg)

    async def on_unpin(self, msg: wire.Unpin) -> None:
        await self.pins.on_unpin(msg)

    async def on_pin_prefix(self, msg: wire.PinPrefix) -> None:
        await self.pins.on_pin_prefix(msg)

    async def on_unpin_prefix(self, msg: wire.UnpinPrefix) -> None:
        await self.pins.on_unpin_prefix(msg)

    # ---- hand-off, abort ----
    async def on_handoff(self, msg: wire.Handoff) -> None:
        await self.handoffs.on_handoff(msg)

    def on_handoff_done(self, msg: wire.HandoffDone) -> None:
        self.handoffs.on_handoff_done(msg)

    def on_abort(self, msg: wire.Abort) -> None:
        self.streams.abort(msg.request_id)
