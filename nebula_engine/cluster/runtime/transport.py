"""Control messages between peers over ZMQ: one ROUTER socket to receive, one DEALER per peer to send.

Sends never block: ZMQ queues a message for a peer that is down (up to its high-water mark) and drops the
queue when the peer's socket closes, so losing a peer never stalls the sender. Messages from one sender to
one receiver arrive in order; across senders there is no order. Senders stay anonymous to ZMQ (no socket
identity): the sender a message names is only believed once its frame is authenticated.

With a cluster secret every frame is sealed (``auth.FrameSealer``): an incoming frame is authenticated before
it is decoded, and one that is not authentic, addressed to another peer, replayed or undecodable is dropped
with one log line per reason per ten seconds. Without a secret (a loopback-only cluster whose operator gave
none) frames travel unsealed, and only undecodable ones are dropped.
"""

from __future__ import annotations

import logging

import msgspec

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.auth import FrameRejected, FrameSealer, RateLimitedLog
from nebula_engine.extras import require_extra

zmq = require_extra("zmq", "cluster")
require_extra("zmq.asyncio", "cluster")  # makes zmq.asyncio an attribute of zmq

logger = logging.getLogger(__name__)


class Messenger:
    def __init__(self, name: str, bind_address: str, peer_addresses: dict[str, str], secret: str | None = None):
        self.name = name
        self.sealer = FrameSealer(name, secret) if secret else None
        self.context = zmq.asyncio.Context()
        self.inbox = self.context.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(bind_address)
        self.peer_addresses = dict(peer_addresses)
        self._outboxes: dict[str, zmq.asyncio.Socket] = {}
        self._drops = RateLimitedLog(logger)
        self.num_dropped = 0

    def send(self, peer: str, message: wire.Msg) -> None:
        if peer == self.name:
            raise ValueError("a peer does not message itself")
        socket = self._outboxes.get(peer)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 10_000)
            socket.connect(self.peer_addresses[peer])
            self._outboxes[peer] = socket
        body = wire.encode(message)
        try:
            socket.send(self.sealer.seal(peer, body) if self.sealer else body, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("dropped a %s for %s: its queue is full", type(message).__name__, peer)

    async def recv(self) -> wire.Msg:
        while True:
            frames = await self.inbox.recv_multipart(copy=False)
            try:
                return self.open([frame.bytes for frame in frames])
            except FrameRejected as error:
                self.num_dropped += 1
                self._drops.warning(error.reason, "%s: dropped a control frame from %s: %s", self.name,
                                    _peer_address(frames[-1]), error)

    def open(self, frames: list[bytes]) -> wire.Msg:
        """The message in one received multipart (identity, frame); raises ``FrameRejected``."""
        if len(frames) != 2:
            raise FrameRejected("malformed", f"{len(frames)} ZMQ frames, expected identity + one")
        stamp, body = self.sealer.open(frames[1]) if self.sealer else (0, frames[1])
        try:
            message = wire.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise FrameRejected("malformed", str(error)[:200]) from None
        if self.sealer:
            self.sealer.accept(message.sender, stamp)
        return message

    def close(self) -> None:
        for socket in self._outboxes.values():
            socket.close(0)
        self.inbox.close(0)
        self.context.term()


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return "an unknown address"
