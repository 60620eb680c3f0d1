"""Leader election across real peer processes on 127.0.0.1: agree, kill the leader, re-elect.

Each peer is a child process that prints one ``leader <id>`` line per change it observes; on
stdin EOF it stops its election and prints how many threads are left. Cross-process conditions
are polled with deadlines.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nebula_engine.cluster.runtime.election import EtcdAccess, ElectionSpec, RaftElection, make_election
from tests.cluster.probes import listening_sockets, payloads, send_raw, send_to_all

REPO_ROOT = Path(__file__).resolve().parents[2]
AGREE_DEADLINE_S = 10.0
REELECT_DEADLINE_S = 10.0

PEER_SCRIPT = """
import json, sys, threading
from nebula_engine.cluster.runtime.election import EtcdAccess, ElectionSpec, make_election
spec = json.loads(sys.argv[1])
spec["etcd_access"] = EtcdAccess(**spec.get("etcd_access", {}))
election = make_election(ElectionSpec(**spec), on_change=lambda leader: print("leader", leader or "-", flush=True))
election.start()
sys.stdin.read()
election.stop()
print("threads", threading.active_count(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Peer:
    """A peer process and the last leader it reported."""

    def __init__(self, spec: dict):
        self.peer_id = spec["self_id"]
        self.process = subprocess.Popen(
            [sys.executable, "-c", PEER_SCRIPT, json.dumps(spec)], cwd=REPO_ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.leader: str | None = None
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.strip())
            kind, _, value = line.strip().partition(" ")
            if kind == "leader":
                self.leader = None if value == "-" else value

    def stop_gracefully(self) -> list[str]:
        self.process.stdin.close()
        assert self.process.wait(timeout=10) == 0
        self._reader.join(timeout=5)
        return self.lines


@pytest.fixture
def spawn():
    peers: list[Peer] = []

    def start(spec: dict) -> Peer:
        peers.append(Peer(spec))
        return peers[-1]

    yield start
    for peer in peers:
        if peer.process.poll() is None:
            peer.process.kill()
            peer.process.wait(timeout=10)


def agreed_leader(peers: list[Peer]) -> str | None:
    views = {peer.leader for peer in peers}
    return views.pop() if len(views) == 1 and None not in views else None


def kill(peer: Peer) -> None:
    peer.process.kill()
    peer.process.wait(timeout=10)


def check_agree_kill_reelect(peers: list[Peer]) -> list[Peer]:
    """Returns the survivors, still running."""
    leader = wait_until(lambda: agreed_leader(peers), AGREE_DEADLINE_S, "three peers to agree on a leader")
    assert leader in {peer.peer_id for peer in peers}
    dead = next(peer for peer in peers if peer.peer_id == leader)
    kill(dead)
    survivors = [peer for peer in peers if peer is not dead]
    new_leader = wait_until(lambda: (agreed := agreed_leader(survivors)) != leader and agreed,
                            REELECT_DEADLINE_S, "the two survivors to agree on a new leader")
    assert new_leader in {peer.peer_id for peer in survivors}
    return survivors


def stop_all(peers: list[Peer]) -> None:
    for peer in peers:
        lines = peer.stop_gracefully()
        assert lines[-2:] == ["leader -", "threads 1"]  # stop() reports None and leaves no thread behind


def test_raft_peers_agree_and_reelect_after_leader_is_killed(spawn):
    addresses = {f"peer{i}": f"127.0.0.1:{free_port()}" for i in range(3)}
    peers = [spawn({"self_id": peer_id, "backend": "raft", "raft_peers": addresses}) for peer_id in addresses]
    stop_all(check_agree_kill_reelect(peers))


def test_raft_with_a_password_listens_on_its_address_only_and_unpickles_nothing_from_outsiders(spawn, tmp_path):
    addresses = {f"peer{i}": f"127.0.0.1:{free_port()}" for i in range(3)}
    peers = [spawn({"self_id": peer_id, "backend": "raft", "raft_peers": addresses, "raft_password": "s" * 32})
             for peer_id in addresses]
    wait_until(lambda: agreed_leader(peers), AGREE_DEADLINE_S, "three peers to agree on a leader")
    for peer in peers:
        own_port = int(addresses[peer.peer_id].rpartition(":")[2])
        assert ("127.0.0.1", own_port) in listening_sockets(peer.process.pid)
        assert all(address == "127.0.0.1" for address, _ in listening_sockets(peer.process.pid))
    marker = tmp_path / "ran"
    send_to_all("127.0.0.1", [int(a.rpartition(":")[2]) for a in addresses.values()], payloads(marker, "127.0.0.1"))
    assert not marker.exists()
    survivors = check_agree_kill_reelect(peers)  # still a working cluster
    kill(survivors[0])  # the last one has no majority: it must stop naming a leader
    wait_until(lambda: survivors[1].leader is None and survivors[1].lines[-1] == "leader -", REELECT_DEADLINE_S,
               "the peer without a majority to report no leader")
    stop_all(survivors[1:])


def test_the_probe_does_run_code_in_a_raft_peer_without_a_password(tmp_path):
    """The control for the test above: without a password, pysyncobj unpickles the probe."""
    address = f"127.0.0.1:{free_port()}"
    election = RaftElection("solo", address, {})
    election.start()
    try:
        marker = tmp_path / "ran"
        send_raw("127.0.0.1", int(address.rpartition(":")[2]), payloads(marker, "127.0.0.1")[1])
        wait_until(marker.exists, 10, "the unauthenticated peer to unpickle the probe")
    finally:
        election.stop()


def test_etcd_peers_agree_and_reelect_after_leader_is_killed(spawn, etcd_endpoint):
    peers = [spawn({"self_id": f"peer{i}", "backend": "etcd", "etcd_endpoint": etcd_endpoint,
                    "ttl_s": 2.0, "key": "/nebula/test-leader"}) for i in range(3)]
    stop_all(check_agree_kill_reelect(peers))


def test_etcd_over_tls_with_a_user_elects_and_refuses_peers_without_credentials(spawn, etcd_tls):
    access = {"ca_cert": etcd_tls.ca, "cert": etcd_tls.cert, "key": etcd_tls.key, "user": "root",
              "password": etcd_tls.password}
    spec = {"backend": "etcd", "etcd_endpoint": etcd_tls.endpoint, "ttl_s": 2.0, "key": "/nebula/tls-leader"}
    peers = [spawn({**spec, "self_id": f"peer{i}", "etcd_access": access}) for i in range(2)]
    no_password = spawn({**spec, "self_id": "intruder", "etcd_access": {**access, "password": "wrong"}})
    no_certificate = spawn({**spec, "self_id": "stranger", "etcd_access": {"ca_cert": etcd_tls.ca}})
    leader = wait_until(lambda: agreed_leader(peers), AGREE_DEADLINE_S, "two peers to agree on a leader")
    assert leader in ("peer0", "peer1")
    assert no_password.leader is None and no_certificate.leader is None
    stop_all(peers)


def test_single_raft_peer_leads_itself_and_reports_every_change():
    threads_before = set(threading.enumerate())
    seen: list[str | None] = []
    election = RaftElection("solo", f"127.0.0.1:{free_port()}", {}, on_change=seen.append)
    election.start()
    try:
        assert election.wait_for_leader(timeout=10) == "solo"
        assert election.is_leader
    finally:
        election.stop()
    assert seen == ["solo", None]
    assert election.leader is None and not election.is_leader
    assert set(threading.enumerate()) == threads_before


def test_wait_for_leader_times_out_without_a_majority():
    unreachable = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    election = RaftElection("self", f"127.0.0.1:{free_port()}", unreachable)
    election.start()
    try:
        with pytest.raises(TimeoutError, match="no leader"):
            election.wait_for_leader(timeout=0.5)
        assert not election.is_leader
    finally:
        election.stop()


def test_raft_refuses_a_port_already_in_use():
    threads_before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match="cannot listen"):
            RaftElection("self", address, {}).start()
    assert set(threading.enumerate()) == threads_before


@pytest.mark.parametrize("spec, message", [
    (ElectionSpec("a", backend="zookeeper"), "unknown election backend"),
    (ElectionSpec("a", raft_peers={"b": "127.0.0.1:1"}), "must include this peer"),
    (ElectionSpec("a", raft_peers={"a": "127.0.0.1", "b": "127.0.0.1:2"}), "is not 'host:port'"),
    (ElectionSpec("a", raft_peers={"a": "127.0.0.1:1", "b": "127.0.0.1:1"}), "share a Raft address"),
    (ElectionSpec("a", backend="etcd", etcd_endpoint="localhost"), "is not 'host:port'"),
    (ElectionSpec("a", backend="etcd", ttl_s=0), "ttl must be positive"),
])
def test_bad_specs_are_refused_with_a_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        make_election(spec)


@pytest.mark.parametrize("options, message", [
    ({"cert": __file__}, "needs both --etcd-cert and --etcd-key"),
    ({"password": "pw"}, "needs --etcd-user"),
    ({"ca_cert": "/nonexistent/ca.pem"}, "--etcd-ca-cert: no file at /nonexistent/ca.pem"),
])
def test_bad_etcd_access_is_refused_with_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        EtcdAccess(**options)


def test_etcd_access_keeps_its_password_out_of_reprs():
    assert "hunter2" not in repr(EtcdAccess(user="u", password="hunter2"))
