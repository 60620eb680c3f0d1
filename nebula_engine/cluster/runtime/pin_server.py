"""One worker as a holder: it pins the KV another peer wants to read (a PIC segment of its store, a cached prefix)
until that peer unpins it. A pin for something a task here is still computing waits for it a while."""

from __future__ import annotations

import logging
import time
from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.in_flight import InFlightKeys, ReadsExpected, lead_key
from nebula_engine.cluster.runtime.remote_reads import PIN_TIMEOUT_S
from nebula_engine.cluster.runtime.worker_codec import encode_state
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.engine.port_types import PrefixPin, SegmentPin

logger = logging.getLogger(__name__)


class PinServer:
    def __init__(self, name: str, kv: KVPort, send: Callable[[str, wire.Msg], None],
                 in_flight: InFlightKeys, reads_expected: ReadsExpected):
        self.name = name
        self.kv = kv
        self.send = send
        self.in_flight = in_flight
        self.reads_expected = reads_expected
        self._pinned: dict[str, list[SegmentPin]] = {}  # key -> pins held for remote readers
        self._pinned_prefixes: dict[tuple[str, str], PrefixPin] = {}  # (reader, tag) -> pin held for it

    def holds_pins(self) -> bool:
        return bool(self._pinned or self._pinned_prefixes)

    def _pins_changed(self) -> None:
        self.reads_expected.set("pins", self.holds_pins())

    async def on_pin(self, msg: wire.PinSegment) -> None:
        start = time.monotonic()
        pin = await self.kv.pin_segment(msg.key, msg.num_tokens)
        if pin is None and msg.wait_s > 0 and msg.key in self.in_flight:  # a task here is computing it
            if await self.in_flight.wait_done(msg.key, msg.wait_s):
                pin = await self.kv.pin_segment(msg.key, msg.num_tokens)
        if pin is None:
            self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=False, pages=[], state=b""))
            return
        try:
            state = await encode_state(pin.state)
        except Exception:
            logger.exception("the state of %s could not be encoded: refusing the pin", msg.key)
            await self.kv.unpin_segment(pin)
            self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=False, pages=[], state=b""))
            return
        self._pinned.setdefault(msg.key, []).append(pin)
        self._pins_changed()
        self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=True, pages=list(pin.pages),
                                            state=state))
        logger.debug("pinned %s for %s in %.4f s", msg.key, msg.sender, time.monotonic() - start)

    async def on_unpin(self, msg: wire.Unpin) -> None:
        pins = self._pinned.get(msg.key)
        if not pins:
            return
        pin = pins.pop()
        if not pins:
            del self._pinned[msg.key]
            self._pins_changed()
        await self.kv.unpin_segment(pin)

    async def on_pin_prefix(self, msg: wire.PinPrefix) -> None:
        """A ``ScatterLead`` here that is prefilling the prefix is waited for: it is pinned once it is cached."""
        await self.in_flight.wait_done(lead_key(msg.token_ids), PIN_TIMEOUT_S / 2)
        pin = await self.kv.pin_prefix(msg.token_ids)
        if pin is not None:
            self._pinned_prefixes[(msg.sender, msg.tag)] = pin
            self._pins_changed()
        self.send(msg.sender, wire.PinReply(sender=self.name, tag=msg.tag, ok=pin is not None,
                                            pages=list(pin.pages) if pin else []))

    async def on_unpin_prefix(self, msg: wire.UnpinPrefix) -> None:
        pin = self._pinned_prefixes.pop((msg.sender, msg.tag), None)
        if pin is not None:
            self._pins_changed()
            await self.kv.unpin_prefix(pin)
