"""One worker reading other peers' KV into its own engine: a PIC segment from its holder's store, a prompt's prefix
from a peer's prefix cache. Pin on the holder, read the pinned pages with NIXL into fresh local pages, store them
locally, unpin. A failed or timed-out read never produces a wrong result: what was not read is computed here.

A pin given up on (no reply in time, its holder counted dead) is remembered: if its reply still comes, the holder
pinned for nothing and is told to unpin.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Callable

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.liveness import Liveness
from nebula_engine.cluster.runtime.transfer import KVTransferAgent, TransferError
from nebula_engine.cluster.runtime.worker_codec import decode_state
from nebula_engine.engine.kv_port import KVPort
from nebula_engine.pic.segments import SegmentedPrompt

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 10.0
MAX_ABANDONED_PINS = 4096  # remembered unanswered pins; older ones are forgotten (their holder is long gone)


async def reply_unless_dead(liveness: Liveness, reply: asyncio.Future, peer: str, timeout: float) -> str:
    """Wait for ``reply`` from ``peer``: "done", or "dead" once ``peer`` counts as dead, or "timed out"."""
    peer_died = asyncio.ensure_future(liveness.wait_dead(peer))
    try:
        await asyncio.wait((reply, peer_died), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        peer_died.cancel()
    if reply.done():
        return "done"
    return "dead" if peer_died.done() else "timed out"


class RemoteReads:
    def __init__(self, name: str, kv: KVPort, agent: KVTransferAgent,
                 send: Callable[[str, wire.Msg], None], liveness: Liveness):
        self.name = name
        self.kv = kv
        self.agent = agent
        self.send = send
        self.liveness = liveness
        self._tags = itertools.count()
        self._pin_replies: dict[str, asyncio.Future] = {}
        # pins given up on (no reply in time, holder counted dead): their unpin, sent if the reply still comes
        self._abandoned_pins: collections.OrderedDict[str, wire.Msg] = collections.OrderedDict()
        self.transfer_failures = 0
        # by what was read: "prefix" and "pic" (reused KV), "handoff" (a prefilled request's KV for its decode)
        self.read_bytes: collections.Counter[str] = collections.Counter()
        self.read_tokens: collections.Counter[str] = collections.Counter()

    @property
    def transfer_bytes(self) -> int:
        return sum(self.read_bytes.values())

    async def read_pages(self, holder: str, remote_pages: list[int], pages: list[int], kind: str,
                         num_tokens: int) -> None:
        """Read ``holder``'s ``remote_pages`` into local ``pages``, ``num_tokens`` tokens of ``kind`` (a key of
        ``read_bytes``); TransferError or ValueError when that fails."""
        self.read_bytes[kind] += await asyncio.to_thread(self.agent.read_pages, holder, remote_pages, pages,
                                                         TRANSFER_TIMEOUT_S)
        self.read_tokens[kind] += num_tokens

    def note_failure(self) -> None:
        """A transfer that failed elsewhere (a hand-off's read) counts with these."""
        self.transfer_failures += 1

    # ---- PIC segments ----
    async def fetch_segment(self, source: wire.SourceSpec, segmented: SegmentedPrompt, spec: str | None,
                            transfers: list[wire.TransferTime]) -> bool:
        """Copy segment ``source`` from its holder into the local PIC store; True when it was copied, and its time
        goes to ``transfers``. On any failure it stays uncached here and the combine computes it. Local pages are
        allocated while the pin travels, so the copy waits for this engine's thread once more (the insert), not
        twice."""
        segment = segmented.pic_segments[source.segment_index]
        ids = list(segmented.segment_ids(segment))
        tag = f"{self.name}/{next(self._tags)}"
        start = time.monotonic()
        reply_future = asyncio.get_running_loop().create_future()
        self._pin_replies[tag] = reply_future
        self.send(source.peer, wire.PinSegment(sender=self.name, tag=tag, key=source.key, num_tokens=len(ids),
                                               wait_s=PIN_TIMEOUT_S / 2))
        allocation = asyncio.ensure_future(self.kv.allocate_pages(  # unless it arrived here meanwhile
            -(-len(ids) // self.kv.page_size), unless_cached=source.key))
        try:
            outcome = await reply_unless_dead(self.liveness, reply_future, source.peer, PIN_TIMEOUT_S)
        except asyncio.CancelledError:
            asyncio.ensure_future(self._release_when_allocated(allocation))
            raise
        finally:
            self._pin_replies.pop(tag, None)
        pages = await allocation
        if outcome != "done":
            self.transfer_failures += 1
            self._abandon_pin(tag, wire.Unpin(sender=self.name, key=source.key))
            logger.warning("no pin reply from %s for %s (%s): computing it here", source.peer, source.key, outcome)
            await self._release(pages)
            return False
        reply = reply_future.result()
        if not reply.ok:
            await self._release(pages)
            return False
        pinned = time.monotonic()
        try:
            copied = await self._copy_in(source, ids, reply, pages)
            if copied:
                transfers.append(wire.TransferTime(source.peer, time.monotonic() - start, len(ids), source.fresh))
            return copied
        finally:
            self.send(source.peer, wire.Unpin(sender=self.name, key=source.key))
            logger.debug("segment of %d tokens from %s: pinned after %.4f s, in the store after %.4f s%s", len(ids),
                         source.peer, pinned - start, time.monotonic() - start, " (prefilled for it)" * source.fresh)

    async def _copy_in(self, source: wire.SourceSpec, ids: list[int], reply: wire.PinReply,
                       pages: list[int] | None) -> bool:
        if pages is None:
            return False
        if len(reply.pages) != len(pages):  # the holder's entry is laid out otherwise (another page size)
            await self._release(pages)
            return False
        try:
            state = await decode_state(reply.state)
        except ValueError as error:
            self.transfer_failures += 1
            logger.warning("the state of %s from %s is unreadable (%s): it will be recomputed", source.key,
                           source.peer, error)
            await self._release(pages)
            return False
        if not await self._read_into(source.peer, reply.pages, pages, source.key, "pic", len(ids)):
            return False
        await self.kv.import_segment(source.key, len(ids), pages, state)
        return True

    # ---- a prompt's prefix ----
    async def fetch_prefix(self, msg: wire.Combine) -> int | None:
        """Copy the prompt's first ``msg.prefix_tokens`` tokens' pages from ``msg.prefix_peer``'s prefix cache into
        this peer's (as its own prefill would have cached them); the engine then finds them as a prefix hit. Only
        the pages past those already cached here are read; on any failure the rest is simply computed. Returns the
        tokens cached here before the read when it added any, else None."""
        page_size = self.kv.page_size
        # the last prompt token is always computed: a prefix covering the whole prompt is cut a page short
        num_pages = min(msg.prefix_tokens, len(msg.token_ids) - 1) // page_size
        wanted = list(msg.token_ids[:num_pages * page_size])
        have = await self.kv.cached_prefix_pages(wanted)
        if have >= num_pages:
            return None
        tag = f"{self.name}/{next(self._tags)}"
        reply_future = asyncio.get_running_loop().create_future()
        self._pin_replies[tag] = reply_future
        self.send(msg.prefix_peer, wire.PinPrefix(sender=self.name, tag=tag, token_ids=wanted))
        try:
            outcome = await reply_unless_dead(self.liveness, reply_future, msg.prefix_peer, PIN_TIMEOUT_S)
        finally:
            self._pin_replies.pop(tag, None)
        if outcome != "done":
            self.transfer_failures += 1
            self._abandon_pin(tag, wire.UnpinPrefix(sender=self.name, tag=tag))
            logger.warning("no prefix pin reply from %s (%s): computing it here", msg.prefix_peer, outcome)
            return None
        reply = reply_future.result()
        try:
            if reply.ok and await self._copy_prefix_in(msg.prefix_peer, wanted, reply.pages, have):
                return have * page_size
            return None
        finally:
            if reply.ok:
                self.send(msg.prefix_peer, wire.UnpinPrefix(sender=self.name, tag=tag))

    async def _copy_prefix_in(self, holder: str, token_ids: list[int], remote_pages: list[int], have: int) -> bool:
        """Read the holder's pages past the ``have`` leading pages cached here and cache them after those."""
        if len(remote_pages) <= have:
            return False
        pages = await self.kv.allocate_pages(len(remote_pages) - have)
        read_tokens = (len(remote_pages) - have) * self.kv.page_size
        if pages is None or not await self._read_into(holder, remote_pages[have:], pages, "a prefix", "prefix",
                                                      read_tokens):
            return False
        return await self.kv.import_prefix(token_ids[:len(remote_pages) * self.kv.page_size], pages, have)

    # ---- pins and pages ----
    def on_pin_reply(self, msg: wire.PinReply) -> None:
        future = self._pin_replies.get(msg.tag)
        if future is not None and not future.done():
            future.set_result(msg)
            return
        unpin = self._abandoned_pins.pop(msg.tag, None)
        if unpin is not None and msg.ok:  # a reply after we gave up: the holder pinned for nothing; release it
            self.send(msg.sender, unpin)

    def _abandon_pin(self, tag: str, unpin: wire.Msg) -> None:
        self._abandoned_pins[tag] = unpin
        while len(self._abandoned_pins) > MAX_ABANDONED_PINS:  # replies from holders that died never come
            self._abandoned_pins.popitem(last=False)

    async def _read_into(self, holder: str, remote_pages: list[int], pages: list[int], what: str, kind: str,
                         num_tokens: int) -> bool:
        """Read ``holder``'s ``remote_pages`` into local ``pages``; on failure the pages are released (and ``what`` is
        recomputed)."""
        try:
            await self.read_pages(holder, remote_pages, pages, kind, num_tokens)
        except (TransferError, ValueError) as error:
            self.transfer_failures += 1
            logger.warning("reading %s from %s failed (%s): it will be recomputed", what, holder, error)
            await self._release(pages)
            return False
        return True

    async def _release_when_allocated(self, allocation: asyncio.Future) -> None:
        await self._release(await allocation)

    async def _release(self, pages: list[int] | None) -> None:
        if pages:
            await self.kv.release_pages(pages)
