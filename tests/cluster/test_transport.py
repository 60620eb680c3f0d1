"""Control frames between two in-process messengers: sealed with the cluster secret, and nothing else accepted."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket

import pytest
import zmq

from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.auth import (FrameRejected, FrameSealer, RateLimitedLog, SecretError, cluster_secret,
                                        new_secret, read_secret_file)
from nebula_engine.cluster.runtime.transport import Messenger

SECRET = new_secret()


def hello(sender: str) -> wire.Hello:
    return wire.Hello(sender=sender, role="prefill", worker_index=1, nixl_metadata=b"meta")


def ephemeral_ports(count: int) -> list[int]:
    """Ports the kernel hands out now, from its ephemeral range: ``launcher.free_ports`` draws cluster peers' ports
    below that range, so the clusters that other test workers start meanwhile cannot be given these."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class Pair:
    """Two messengers, ``a`` and ``b``, on loopback ports."""

    def __init__(self, secret_a: str | None = SECRET, secret_b: str | None = SECRET):
        port_a, port_b = ephemeral_ports(2)
        self.address_b = f"tcp://127.0.0.1:{port_b}"
        self.a = Messenger("a", f"tcp://127.0.0.1:{port_a}", {"b": self.address_b}, secret_a)
        self.b = Messenger("b", self.address_b, {"a": f"tcp://127.0.0.1:{port_a}"}, secret_b)

    def raw_sender(self) -> zmq.Socket:
        """A plain DEALER to ``b``: what anyone on the network can open."""
        socket = self.a.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address_b)
        return socket

    def close(self) -> None:
        self.a.close()
        self.b.close()


async def accepted_until_marker(pair: Pair, raw: zmq.Socket) -> list[wire.Msg]:
    """What ``b`` accepts up to a genuine marker Hello sent last on ``raw`` (one connection keeps order)."""
    marker = wire.Hello(sender="a", role="prefill", worker_index=99, nixl_metadata=b"")
    raw.send(pair.a.sealer.seal("b", wire.encode(marker)))
    accepted = []
    while not accepted or accepted[-1] != marker:
        accepted.append(await asyncio.wait_for(pair.b.recv(), 10))
    return accepted


@pytest.fixture
def pair():
    """A ``Pair`` whose sockets belong to a fresh event loop, ``pair.run`` runs coroutines on it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    created = Pair()
    created.run = loop.run_until_complete
    yield created
    created.close()
    asyncio.set_event_loop(None)
    loop.close()


def test_sealed_messages_arrive_in_order(pair):
    async def run():
        for index in range(5):
            pair.a.send("b", wire.Hello(sender="a", role="prefill", worker_index=index, nixl_metadata=b"m"))
        return [await asyncio.wait_for(pair.b.recv(), 10) for _ in range(5)]

    assert [m.worker_index for m in pair.run(run())] == [0, 1, 2, 3, 4]


def test_unsealed_forged_and_malformed_frames_are_dropped_with_one_line_each(pair, caplog):
    evil = pickle.dumps(print)
    outsider = FrameSealer("a", new_secret())  # the right format, the wrong secret

    raw = pair.raw_sender()
    try:
        for _ in range(50):
            raw.send(wire.encode(hello("prefill-1")))  # unsealed, claiming to be prefill-1
            raw.send(evil)
            raw.send(outsider.seal("b", wire.encode(hello("a"))))
            raw.send_multipart([b"x", b"y"])  # too many frames
        raw.send(pair.a.sealer.seal("b", wire.encode(hello("a"))))
        with caplog.at_level(logging.WARNING, logger="nebula_engine.cluster.runtime.transport"):
            accepted = pair.run(accepted_until_marker(pair, raw))
    finally:
        raw.close()
    assert [m.worker_index for m in accepted] == [1, 99]
    assert pair.b.num_dropped == 200
    reasons = sorted(r.getMessage().split(": ")[2] for r in caplog.records)
    assert reasons == ["forged", "malformed", "unsealed"], reasons  # one line per reason, no traceback
    assert not any(r.exc_info for r in caplog.records)


def test_a_recorded_frame_cannot_be_played_again_or_to_another_peer(pair):
    body = wire.encode(hello("a"))
    recorded = pair.a.sealer.seal("b", body)
    assert pair.b.open([b"a", recorded]) == hello("a")
    with pytest.raises(FrameRejected, match="replayed"):
        pair.b.open([b"a", recorded])
    with pytest.raises(FrameRejected, match="forged"):
        pair.a.open([b"b", pair.b.sealer.seal("c", wire.encode(hello("b")))])  # addressed to c, not a


def test_a_restarted_receiver_refuses_frames_from_before_its_start():
    clock = {"now": 1_000 * 10**9}
    sender = FrameSealer("a", SECRET, clock_ns=lambda: clock["now"])
    old = sender.seal("b", wire.encode(hello("a")))
    clock["now"] += 10**12  # 1000 s later b (re)starts
    receiver = FrameSealer("b", SECRET, clock_ns=lambda: clock["now"])
    stamp, _ = receiver.open(old)
    with pytest.raises(FrameRejected, match="replayed"):
        receiver.accept("a", stamp)
    fresh_stamp, _ = receiver.open(sender.seal("b", b"x"))
    receiver.accept("a", fresh_stamp)


def test_without_a_secret_only_undecodable_frames_are_dropped():
    unsealed = Pair(None, None)
    try:
        assert unsealed.b.open([b"a", wire.encode(hello("a"))]) == hello("a")
        with pytest.raises(FrameRejected, match="malformed"):
            unsealed.b.open([b"a", pickle.dumps(print)])
    finally:
        unsealed.close()


def test_rate_limited_log_counts_what_it_suppressed(caplog):
    now = {"t": 0.0}
    log = RateLimitedLog(logging.getLogger("test.ratelimit"), interval_s=10, clock=lambda: now["t"])
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for step in range(30):
            now["t"] = step
            log.warning("k", "dropped")
    assert [r.getMessage() for r in caplog.records] == [
        "dropped", "dropped (9 more like it in the last 10 s)", "dropped (9 more like it in the last 10 s)"]


def test_secret_sources_and_their_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("NEBULA_CLUSTER_SECRET", raising=False)
    assert cluster_secret() is None
    monkeypatch.setenv("NEBULA_CLUSTER_SECRET", "e" * 32)
    assert cluster_secret() == "e" * 32
    assert cluster_secret(flag="f" * 16) == "f" * 16
    with pytest.raises(SecretError, match="at least 16"):
        cluster_secret(flag="short")
    path = tmp_path / "secret"
    path.write_text("g" * 20 + "\n")
    path.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret_file(path)
    path.chmod(0o600)
    assert cluster_secret(file=path) == "g" * 20
    with pytest.raises(SecretError, match="not both"):
        cluster_secret(flag="f" * 16, file=path)
