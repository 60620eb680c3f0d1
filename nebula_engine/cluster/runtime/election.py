"""Leader election among peer engine processes: which peer runs the router.

Two backends behind one interface, selected by name (``ELECTIONS``):

- ``raft``: embedded Raft (pysyncobj) among a fixed set of peers; needs no external service, so a
  single-machine deployment runs with nothing else. A majority of peers must be up to elect. It listens
  on its own address only, and with a ``password`` every frame is authenticated and encrypted (Fernet)
  before pysyncobj unpickles it.
- ``etcd``: a lease plus create-if-absent key in etcd (through its HTTP gateway, etcd3gw), for
  clusters that span machines. Any number of peers; etcd keeps the quorum. ``EtcdAccess`` holds the
  usual TLS files and etcd user.

Invariants: ``leader`` is a peer id (never an address) or None while unknown, including while this
peer cannot reach a quorum (Raft: a majority of peers; etcd: etcd itself), so a peer cut off from the
cluster never names a leader it cannot know is alive; ``has_quorum`` says which. Every change of
``leader``, including to None on ``stop()``, is reported once to ``on_change`` from a background thread,
so the callback must be quick and must not call ``stop()``. ``stop()`` joins every thread ``start()``
made. Raft keeps ticking only while the thread that called ``start()`` is alive (pysyncobj's rule).
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nebula_engine.extras import require_extra

logger = logging.getLogger(__name__)

LeaderCallback = Callable[[str | None], None]

# Measured on loopback: first election 0.5-0.8 s, re-election after a kill 0.5-2.2 s.
RAFT_TIMEOUTS = {"raftMinTimeout": 0.4, "raftMaxTimeout": 1.0, "connectionRetryTime": 0.5,
                 # a leader cut off from the majority steps down this fast (pysyncobj default: 30 s)
                 "leaderFallbackTimeout": 1.0}


class LeaderElection(ABC):
    """One per peer process. Subclasses report what they observe through ``_publish``."""

    def __init__(self, self_id: str, on_change: LeaderCallback | None = None):
        """``on_change``: told each new leader (None included), from a background thread."""
        if not self_id:
            raise ValueError("peer id must be a non-empty string")
        self.self_id = self_id
        self.on_change = on_change
        self._leader: str | None = None
        self._quorum = False
        self._changed = threading.Condition()

    @abstractmethod
    def start(self) -> None:
        """Join the election; returns once this peer takes part (ports bound, threads running)."""

    @abstractmethod
    def stop(self) -> None:
        """Leave the election and join every background thread; idempotent."""

    @property
    def leader(self) -> str | None:
        with self._changed:
            return self._leader

    @property
    def has_quorum(self) -> bool:
        """This peer reaches enough of the cluster (or etcd) for an election to hold."""
        with self._changed:
            return self._quorum

    @property
    def is_leader(self) -> bool:
        return self.leader == self.self_id

    def wait_for_leader(self, timeout: float) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: self._leader is not None, timeout):
                raise TimeoutError(f"peer {self.self_id!r}: no leader known after {timeout} s")
            return self._leader

    def _publish(self, leader: str | None, quorum: bool) -> None:
        with self._changed:
            self._quorum = quorum
            if leader == self._leader:
                return
            self._leader = leader
            self._changed.notify_all()
        callback = self.on_change
        if callback is not None:
            try:
                callback(leader)
            except Exception:  # a failing listener must not stop the election thread
                logger.exception("leader-change callback failed")


def _check_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not 'host:port'")
    return address


class RaftElection(LeaderElection):
    """Raft among fixed peers. ``peer_addresses`` maps peer id -> Raft "host:port"; it may include
    this peer (then with ``self_address``). Peers of one cluster share ``password`` (None: unauthenticated,
    which is only safe where nobody else can reach the Raft ports)."""

    def __init__(self, self_id: str, self_address: str, peer_addresses: Mapping[str, str],
                 password: str | None = None, on_change: LeaderCallback | None = None):
        super().__init__(self_id, on_change)
        self._password = password
        self.self_address = _check_address(self_address)
        if peer_addresses.get(self_id, self_address) != self_address:
            raise ValueError(f"peer {self_id!r} listed at {peer_addresses[self_id]!r}, "
                             f"but its own address is {self_address!r}")
        addresses = {**{p: _check_address(a) for p, a in peer_addresses.items()}, self_id: self_address}
        self._id_by_address = {address: peer for peer, address in addresses.items()}
        if len(self._id_by_address) != len(addresses):
            raise ValueError(f"two peers share a Raft address: {addresses}")
        self._other_addresses = sorted(a for p, a in addresses.items() if p != self_id)
        self._sync = None

    def start(self) -> None:
        require_extra("pysyncobj", "cluster")
        from pysyncobj import SyncObj, SyncObjConf, SyncObjException

        if self._sync is not None:
            raise RuntimeError(f"raft election of {self.self_id!r} already started")
        conf = SyncObjConf(**RAFT_TIMEOUTS, maxBindRetries=1, bindAddress=self.self_address,
                           password=self._password)
        sync = SyncObj(self.self_address, self._other_addresses, conf=conf)
        try:
            sync.waitBinded()
        except SyncObjException as error:
            sync.destroy_synchronous()
            raise OSError(f"raft: cannot listen on {self.self_address}") from error
        self._sync = sync
        sync.addOnTickCallback(self._on_tick)

    def stop(self) -> None:
        sync, self._sync = self._sync, None
        if sync is None:
            return
        sync.destroy_synchronous()
        self._publish(None, False)

    def _on_tick(self) -> None:  # on pysyncobj's tick thread, every ~50 ms
        sync = self._sync
        # a follower that lost every partner never becomes a candidate, so pysyncobj keeps naming the old leader
        quorum = sync is not None and sync.hasQuorum
        node = sync._getLeader() if quorum else None
        self._publish(None if node is None else self._id_by_address.get(node.address), quorum)


ETCD_PASSWORD_ENV = "NEBULA_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdAccess:
    """How a peer reaches etcd beyond host:port: TLS (a CA to verify etcd, a client certificate + key) and an
    etcd user. Paths are checked when built; the password never appears in a repr."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("an etcd client certificate needs both --etcd-cert and --etcd-key")
        if self.password is not None and not self.user:
            raise ValueError(f"an etcd password (${ETCD_PASSWORD_ENV}) needs --etcd-user")
        for name, path in (("--etcd-ca-cert", self.ca_cert), ("--etcd-cert", self.cert), ("--etcd-key", self.key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no file at {path}")

    @property
    def protocol(self) -> str:
        return "https" if self.ca_cert or self.cert else "http"

    def session(self):
        import requests

        session = requests.Session()
        if self.ca_cert:
            session.verify = self.ca_cert
            session.trust_env = False  # else $REQUESTS_CA_BUNDLE silently replaces our CA (https://github.com/psf/requests/issues/3829)
        if self.cert:
            session.cert = (self.cert, self.key)
        return session


class EtcdElection(LeaderElection):
    """The leader is whoever created ``key`` (value: its peer id) under a lease it keeps alive.

    Every ``ttl / 3`` seconds a peer refreshes its lease, tries to create the key (succeeds only
    when it is absent: the old leader's lease expired or was revoked) and reads who holds it.
    A dead leader's key disappears after at most ``ttl``; ``stop()`` revokes the lease at once.
    With an etcd user, the peer signs in first and again after any failure (its token may have expired).
    """

    def __init__(self, self_id: str, host: str, port: int, ttl: float = 2.0, key: str = "/nebula/leader",
                 access: EtcdAccess = EtcdAccess(), on_change: LeaderCallback | None = None):
        super().__init__(self_id, on_change)
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        self.host, self.port, self.key = host, port, key
        self.access = access
        self._signed_in = False
        self._lease_ttl_s = max(1, math.ceil(ttl))  # etcd leases have whole-second TTLs
        self._period_s = ttl / 3
        self._client = None
        self._lease = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        require_extra("etcd3gw", "cluster")
        from etcd3gw.client import Etcd3Client

        if self._thread is not None:
            raise RuntimeError(f"etcd election of {self.self_id!r} already started")
        self._client = Etcd3Client(self.host, self.port, protocol=self.access.protocol, api_path="/v3/",
                                   timeout=max(0.5, self._period_s), session=self.access.session())
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"etcd-election-{self.self_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        thread.join()
        if self._lease is not None:
            try:
                self._lease.revoke()  # hands the key over now instead of after the TTL
            except _etcd_errors() as error:
                logger.warning("etcd: could not revoke lease of %s: %s", self.self_id, error)
            self._lease = None
        self._client.session.close()
        self._publish(None, False)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._publish(self._campaign_once(), True)
            except _etcd_errors() as error:
                logger.warning("etcd at %s:%s unreachable: %s", self.host, self.port, error)
                self._lease = None  # cannot prove it is alive: campaign afresh once etcd answers
                self._signed_in = False
                self._publish(None, False)
            self._stopping.wait(self._period_s)

    def _sign_in(self) -> None:
        """etcd's gateway: POST auth/authenticate gives a token that goes in every later request's header."""
        self._client.session.headers.pop("Authorization", None)
        reply = self._client.post(self._client.get_url("/auth/authenticate"),
                                  json={"name": self.access.user, "password": self.access.password or ""})
        self._client.session.headers["Authorization"] = reply["token"]
        self._signed_in = True

    def _campaign_once(self) -> str | None:
        if self.access.user and not self._signed_in:
            self._sign_in()
        if not self._lease_alive():
            self._lease = self._client.lease(self._lease_ttl_s)
        if self._client.create(self.key, self.self_id, lease=self._lease):
            return self.self_id
        values = self._client.get(self.key)
        return values[0].decode() if values else None  # None: released meanwhile; campaign next round

    def _lease_alive(self) -> bool:
        from etcd3gw.exceptions import Etcd3Exception

        if self._lease is None:
            return False
        try:
            return self._lease.refresh() > 0
        except Etcd3Exception:  # the gateway answers an unknown (expired) lease with an error
            return False


def _etcd_errors() -> tuple[type[Exception], ...]:
    from etcd3gw.exceptions import Etcd3Exception
    from requests import RequestException

    return Etcd3Exception, RequestException, ValueError, KeyError  # a reply that is not JSON / has no token


@dataclass(frozen=True)
class ElectionSpec:
    """How one peer takes part; ``backend`` is the name users type (``raft`` or ``etcd``)."""

    self_id: str
    backend: str = "raft"
    raft_peers: Mapping[str, str] = field(default_factory=dict)  # peer id -> Raft "host:port", self included
    raft_password: str | None = field(default=None, repr=False)
    etcd_endpoint: str = "127.0.0.1:2379"
    etcd_access: EtcdAccess = EtcdAccess()
    ttl_s: float = 2.0  # etcd lease
    key: str = "/nebula/leader"  # etcd key


def _make_raft(spec: ElectionSpec, on_change: LeaderCallback | None) -> LeaderElection:
    if spec.self_id not in spec.raft_peers:
        raise ValueError(f"raft peers {sorted(spec.raft_peers)} must include this peer {spec.self_id!r}")
    return RaftElection(spec.self_id, spec.raft_peers[spec.self_id], spec.raft_peers, spec.raft_password,
                        on_change=on_change)


def _make_etcd(spec: ElectionSpec, on_change: LeaderCallback | None) -> LeaderElection:
    host, _, port = _check_address(spec.etcd_endpoint).rpartition(":")
    return EtcdElection(spec.self_id, host, int(port), ttl=spec.ttl_s, key=spec.key, access=spec.etcd_access,
                        on_change=on_change)


ELECTIONS: dict[str, Callable[[ElectionSpec, LeaderCallback | None], LeaderElection]] = {"raft": _make_raft,
                                                                                         "etcd": _make_etcd}


def make_election(spec: ElectionSpec, on_change: LeaderCallback | None = None) -> LeaderElection:
    """The election ``spec`` names; ``on_change`` is told each new leader (``LeaderElection``)."""
    if spec.backend not in ELECTIONS:
        raise ValueError(f"unknown election backend {spec.backend!r}; known: {', '.join(ELECTIONS)}")
    return ELECTIONS[spec.backend](spec, on_change)
