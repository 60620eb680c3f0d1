"""What a cluster is made of (``ClusterSpec``: its peers and where each one listens) and how one peer runs beyond
that (``PeerSettings``: secrets, etcd access, failure bounds).

Every listener of a peer (control ZMQ, Raft, NIXL/UCX) binds to its ``host``; its HTTP API binds to
``http_host`` (default: ``host``), so a local cluster can expose its API while everything else stays on
loopback. A spec whose hosts are not all loopback addresses spans machines, and then its peers need the
cluster secret (``check_secured``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from dataclasses import asdict, dataclass, field

from nebula_engine.cluster.control.policy_names import POLICY_NAMES
from nebula_engine.cluster.runtime.auth import SECRET_ENV, SecretError
from nebula_engine.cluster.runtime.election import EtcdAccess
from nebula_engine.cluster.runtime.liveness import DEFAULT_DEAD_AFTER_S, DEFAULT_FAILOVER_TIMEOUT_S
from nebula_engine.server.limits import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

API_KEY_ENV = "NEBULA_API_KEY"
PORT_TAKEN_EXIT = 75  # a peer process's exit status when one of its listen addresses is taken (EX_TEMPFAIL)


@dataclass(frozen=True)
class PeerSpec:
    name: str
    role: str  # "prefill" | "decode"
    host: str
    ctrl_port: int
    raft_port: int
    http_port: int
    worker_index: int  # 0..N-1 for prefill peers, -1 for decode peers
    http_host: str = ""  # "" = host

    @property
    def ctrl_address(self) -> str:
        return f"tcp://{self.host}:{self.ctrl_port}"

    @property
    def api_host(self) -> str:
        return self.http_host or self.host

    @property
    def url(self) -> str:
        return f"http://{self.api_host}:{self.http_port}"


@dataclass(frozen=True)
class ClusterSpec:
    peers: tuple[PeerSpec, ...]
    policy: str = "nebula"
    etcd: str | None = None  # "host:port": etcd leases instead of the embedded Raft election
    # the planner's fixed cost of reading KV from another peer, paid once per source: a pin round trip and the
    # insert, both under the peers' cache locks (served while a step computes). 17 ms is the median from pin sent
    # to segment stored of the 71 segments already cached on their holder that two default compares read with every
    # read and scatter planned (nebula, 4 one-thread bench-qwen3 peers on 2 cores; the router's debug log "transfer
    # from ..."). Measure a deployment's own the same way and set it in its cluster spec
    remote_read_latency_s: float = 0.017
    # the planner's fixed cost of scattering a cold segment to another peer, beyond its prefill and the read
    # (ClusterProfile.dispatch_s): the helper finishes its step in progress before it prefills. 8 ms is the median
    # of (pin sent to segment stored) - (its predicted prefill) - remote_read_latency_s over the 151 scattered
    # segments of the same two compares. With the prefill predicted at the leader's idle speed the residual is 23 ms,
    # but that also holds the helper's slowdown beside the other peers, which the planner charges as shared cores
    # already (counted twice, nebula's TTFT p50 was 0.94, 0.94 and 0.77x local-pic's in three compares), so 8 ms
    scatter_dispatch_s: float = 0.008
    # peers on this one machine share its cores, and the planner bounds a plan by what they can do together
    # (TransferCosts.parallel_forwards); False plans as if each peer had processors of its own (Algorithm 1)
    shared_cores: bool = True
    # True: the two fixed costs above are where the router starts, and it then charges what the homes report
    # reads and scatters take (ObservedTransferCosts). Off by default: on the default compare, nebula alone with it
    # read 12.5-12.9 MB instead of 0.8-2.4 MB and its TTFT p50 was 0.250-0.264 s instead of 0.220-0.232 s (two
    # interleaved pairs): a read's pin-to-stored time leaves out what it costs the peers' shared cores
    observe_transfer_costs: bool = False

    def __post_init__(self) -> None:
        for name in ("remote_read_latency_s", "scatter_dispatch_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown cluster policy {self.policy!r}; choose from {POLICY_NAMES}")
        if not any(p.role == "prefill" for p in self.peers):
            raise ValueError("a cluster needs at least one prefill peer")
        if len({p.name for p in self.peers}) != len(self.peers):
            raise ValueError("peer names must be unique")

    @property
    def prefill_peers(self) -> list[PeerSpec]:
        return sorted((p for p in self.peers if p.role == "prefill"), key=lambda p: p.worker_index)

    @property
    def decode_peers(self) -> list[PeerSpec]:
        return [p for p in self.peers if p.role == "decode"]

    @property
    def spans_machines(self) -> bool:
        """Some peer's internal listeners are on an address other machines can reach."""
        return not all(is_loopback(p.host) for p in self.peers)

    def listen_addresses(self, name: str) -> list[tuple[str, int, str]]:
        """(host, port, which field) of every listener peer ``name`` opens: HTTP, the control channel and, without
        etcd, Raft."""
        peer = self.peer(name)
        kinds = ("http_port", "ctrl_port") if self.etcd else ("http_port", "ctrl_port", "raft_port")
        return [(peer.api_host if kind == "http_port" else peer.host, getattr(peer, kind), kind) for kind in kinds]

    def peer(self, name: str) -> PeerSpec:
        for spec in self.peers:
            if spec.name == name:
                return spec
        raise ValueError(f"no peer named {name!r} in the cluster spec; peers: {[p.name for p in self.peers]}")

    def to_json(self) -> str:
        return json.dumps({"policy": self.policy, "etcd": self.etcd, "remote_read_latency_s": self.remote_read_latency_s,
                           "scatter_dispatch_s": self.scatter_dispatch_s, "shared_cores": self.shared_cores,
                           "observe_transfer_costs": self.observe_transfer_costs,
                           "peers": [asdict(p) for p in self.peers]})

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        data = json.loads(text)
        return cls(tuple(PeerSpec(**p) for p in data["peers"]), data.get("policy", "nebula"), data.get("etcd"),
                   data.get("remote_read_latency_s", cls.remote_read_latency_s),
                   data.get("scatter_dispatch_s", cls.scatter_dispatch_s), bool(data.get("shared_cores", cls.shared_cores)),
                   bool(data.get("observe_transfer_costs", cls.observe_transfer_costs)))


@dataclass(frozen=True)
class PeerSettings:
    """What a peer needs beyond the spec. Secrets never appear in a repr."""

    cluster_secret: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)  # clients' ``Authorization: Bearer`` for /v1/*
    etcd_access: EtcdAccess = EtcdAccess()
    peer_timeout_s: float = DEFAULT_DEAD_AFTER_S  # silence after which a peer counts as dead
    failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S  # a request whose peer died is re-run or failed by then
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger HTTP body is a 413

    def __post_init__(self) -> None:
        if self.peer_timeout_s <= 0:
            raise ValueError(f"--peer-timeout must be positive, got {self.peer_timeout_s}")
        if self.failover_timeout_s <= self.peer_timeout_s:
            raise ValueError(f"--failover-timeout ({self.failover_timeout_s} s) must exceed --peer-timeout "
                             f"({self.peer_timeout_s} s): a request is only re-run once its peer is known dead")


def check_secured(spec: ClusterSpec, settings: PeerSettings) -> None:
    """Refuse a cluster spanning machines without a secret; warn about an unauthenticated loopback one."""
    if settings.cluster_secret:
        return
    if spec.spans_machines:
        raise SecretError(f"this cluster spans machines (hosts {sorted({p.host for p in spec.peers})}), so its peers "
                          f"must authenticate each other: give every peer the same --cluster-secret-file, or "
                          f"${SECRET_ENV}, or --cluster-secret")
    logger.warning("no cluster secret: Raft and control messages are unauthenticated, so any local user can "
                   "reach this cluster (set $%s)", SECRET_ENV)


def is_loopback(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
