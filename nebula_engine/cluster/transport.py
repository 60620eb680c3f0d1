"""Control messages between peers over ZMQ: one ROUTER socket to receive, one DEALER per peer to send.

Sends never block: ZMQ queues a message for a peer that is down (up to its high-water mark) and drops the
queue when the peer's socket closes, so losing a peer never stalls the sender. Messages from one sender to
one receiver arrive in order; across senders there is no order.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from nebula_engine.cluster import wire

logger = logging.getLogger(__name__)


class Messenger:
    def __init__(self, name: str, bind_address: str, peer_addresses: dict[str, str]):
        self.name = name
        self.context = zmq.asyncio.Context()
        self.inbox = self.context.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(bind_address)
        self.peer_addresses = dict(peer_addresses)
        self._outboxes: dict[str, zmq.asyncio.Socket] = {}

    def send(self, peer: str, message: wire.Msg) -> None:
        if peer == self.name:
            raise ValueError("a peer does not message itself")
        socket = self._outboxes.get(peer)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 10_000)
            socket.setsockopt_string(zmq.IDENTITY, self.name)
            socket.connect(self.peer_addresses[peer])
            self._outboxes[peer] = socket
        try:
            socket.send(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("dropped a %s for %s: its queue is full", type(message).__name__, peer)

    async def recv(self) -> wire.Msg:
        while True:
            frames = await self.inbox.recv_multipart()
            try:
                return wire.decode(frames[-1])
            except Exception:
                logger.exception("undecodable message from %r", frames[0])

    def close(self) -> None:
        for socket in self._outboxes.values():
            socket.close(0)
        self.inbox.close(0)
        self.context.term()
