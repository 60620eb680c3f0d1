"""Start a whole cluster on this machine: one process per peer, no external service (embedded Raft).

``LocalCluster`` is used by ``nebula-engine serve --prefill-workers N``, by ``tools/bench_cluster.py`` and by the
multi-process tests. It owns the processes it starts and stops them (SIGTERM, then SIGKILL) by their pids.
Its peers' internal listeners (control, Raft, NIXL) are on loopback; only their HTTP APIs may listen elsewhere.
Every port it opens is drawn from one ``PortRange`` (by default ``DEFAULT_PORT_RANGE``; NIXL's UCX listeners
through ``UCX_TCP_PORT_RANGE``), so a firewall or a shared machine can confine a local cluster to it.
Unless given one, it draws a random cluster secret and hands it (and the API key) to its peers in their
environment, never on a command line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from nebula_engine.cluster.runtime.auth import SECRET_ENV, new_secret
from nebula_engine.cluster.runtime.election import ETCD_PASSWORD_ENV
from nebula_engine.cluster.runtime.spec import API_KEY_ENV, PORT_TAKEN_EXIT, ClusterSpec, PeerSettings, PeerSpec

LOOPBACK = "127.0.0.1"
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"  # UCX's TCP transport binds its listeners inside this range


@dataclass(frozen=True)
class PortRange:
    """Ports ``low..high`` (both included) a local cluster may listen on."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= 65535:
            raise ValueError(f"a port range is LOW-HIGH with 1 <= LOW <= HIGH <= 65535, got {self}")

    @classmethod
    def parse(cls, text: str) -> PortRange:
        low, sep, high = text.partition("-")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ValueError(f"a port range is written LOW-HIGH (e.g. 20000-20100), got {text!r}")
        return cls(int(low), int(high))

    def __contains__(self, port: int) -> bool:
        return self.low <= port <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def default_port_range() -> PortRange:
    """10000 up to the kernel's ephemeral range (at least to 20000): a port the kernel hands out itself could be
    taken by some process's outgoing connection before our peer binds it."""
    low, _ = _ephemeral_range()
    return PortRange(10_000, max(low, 20_000) - 1)


def free_ports(count: int, host: str = "127.0.0.1", avoid: list[int] = (), port_range: PortRange | None = None
               ) -> list[int]:
    """``count`` distinct ports of ``port_range`` (default: ``default_port_range()``) free now on ``host``;
    ValueError when the range has fewer."""
    port_range = port_range or default_port_range()
    candidates = [p for p in range(port_range.low, port_range.high + 1) if p not in avoid]
    random.Random().shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        if len(ports) == count:
            break
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    if len(ports) < count:
        raise ValueError(f"port range {port_range} has {len(ports)} free ports on {host}; this local cluster "
                         f"needs {count}: widen --port-range")
    return ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def local_spec(num_prefill: int, num_decode: int, host: str = LOOPBACK, port: int = 0, policy: str = "nebula",
               etcd: str | None = None, remote_read_latency_s: float = ClusterSpec.remote_read_latency_s,
               scatter_dispatch_s: float = ClusterSpec.scatter_dispatch_s,
               shared_cores: bool = ClusterSpec.shared_cores,
               observe_transfer_costs: bool = ClusterSpec.observe_transfer_costs,
               port_range: PortRange | None = None) -> ClusterSpec:
    """Peers ``prefill-0..`` then ``decode-0..``; HTTP on ``host``, ports ``port, port+1, ...`` (free ports when 0);
    every other listener on loopback. Drawn ports come from ``port_range``; given HTTP ports must lie in it."""
    if num_prefill < 1 or num_decode < 0:
        raise ValueError(f"need >= 1 prefill and >= 0 decode workers, got {num_prefill} and {num_decode}")
    count = num_prefill + num_decode
    fixed_http = [] if port == 0 else [port + i for i in range(count)]
    outside = [p for p in fixed_http if port_range is not None and p not in port_range]
    if outside:
        raise ValueError(f"the HTTP ports {fixed_http[0]}-{fixed_http[-1]} (--port, --port+1, ...) are not all in "
                         f"--port-range {port_range}: give --port 0 to draw them from the range, or a port inside it")
    internal = free_ports(2 * count, LOOPBACK, avoid=fixed_http, port_range=port_range)
    http = fixed_http or free_ports(count, host, avoid=internal, port_range=port_range)
    peers = []
    for i in range(count):
        role, index = ("prefill", i) if i < num_prefill else ("decode", -1)
        name = f"prefill-{i}" if role == "prefill" else f"decode-{i - num_prefill}"
        peers.append(PeerSpec(name, role, LOOPBACK, internal[2 * i], internal[2 * i + 1], http[i], index,
                              http_host="" if host == LOOPBACK else host))
    return ClusterSpec(tuple(peers), policy, etcd, remote_read_latency_s, scatter_dispatch_s, shared_cores,
                       observe_transfer_costs)


def with_new_ports(spec: ClusterSpec, keep_http: bool, port_range: PortRange | None = None) -> ClusterSpec:
    """``spec`` with freshly drawn free ports for every peer's control and Raft listeners and, unless ``keep_http``,
    its HTTP listener (as ``local_spec`` draws them, from ``port_range``)."""
    kept_http = [p.http_port for p in spec.peers] if keep_http else []
    internal = free_ports(2 * len(spec.peers), LOOPBACK, avoid=kept_http, port_range=port_range)
    http = kept_http or free_ports(len(spec.peers), spec.peers[0].api_host, avoid=internal, port_range=port_range)
    return replace(spec, peers=tuple(replace(p, ctrl_port=internal[2 * i], raft_port=internal[2 * i + 1],
                                             http_port=http[i]) for i, p in enumerate(spec.peers)))


class PortTaken(RuntimeError):
    """A peer could not listen where its spec says: another process took the port after it was drawn."""


PORT_TAKEN_LOG = b"address already in use"  # what uvicorn and zmq say when the port went between check and bind
START_ATTEMPTS = 3


class LocalCluster:
    """Peers of ``spec`` as processes of this machine. Its ports are drawn free (``local_spec``), but another
    process may take one before a peer binds it: a start that fails so stops every peer and starts again on newly
    drawn ports (``START_ATTEMPTS`` in all), keeping the HTTP ports when ``keep_http_ports`` (a user's ``--port``:
    then a taken one is an error). Redrawn ports, and the ports NIXL's UCX listens on, come from ``port_range``
    (the one ``spec`` was drawn from; None: the default range, UCX's ports unconfined). Read ``spec`` and ``urls``
    after ``start``."""

    def __init__(self, model: str, spec: ClusterSpec, engine_options: dict | None = None,
                 served_model_name: str | None = None, log_dir: str | Path | None = None, log_level: str = "warning",
                 settings: PeerSettings = PeerSettings(), torch_threads: int | None = None,
                 keep_http_ports: bool = False, port_range: PortRange | None = None):
        if spec.spans_machines:
            raise ValueError("a local cluster runs on this machine: every peer's host must be a loopback address")
        self.model = model
        self.spec = spec
        self.settings = settings if settings.cluster_secret else replace(settings, cluster_secret=new_secret())
        self.engine_options = engine_options or {}
        self.served_model_name = served_model_name or model
        self.keep_http_ports = keep_http_ports
        self.port_range = port_range
        self._tmp = tempfile.TemporaryDirectory(prefix="nebula-cluster-")
        self.log_dir = Path(log_dir or self._tmp.name)
        self.log_level = log_level
        self.torch_threads = torch_threads  # intra-op threads of each peer's torch (None: torch's default)
        self.processes: dict[str, subprocess.Popen] = {}
        self._log_starts: dict[str, int] = {}

    @property
    def urls(self) -> dict[str, str]:
        return {p.name: p.url for p in self.spec.peers}

    def start(self, timeout: float = 180.0) -> LocalCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec_file = Path(self._tmp.name) / "cluster.json"
        for attempt in range(1, START_ATTEMPTS + 1):
            spec_file.write_text(self.spec.to_json())
            try:
                for peer in self.spec.peers:
                    self._spawn(peer.name, spec_file)
                self.wait_ready(timeout)
                return self
            except PortTaken:
                self._stop_peers()
                if attempt == START_ATTEMPTS:
                    self.stop()
                    raise
                self.spec = with_new_ports(self.spec, self.keep_http_ports, self.port_range)
            except BaseException:
                self.stop()  # never leave peers behind when the cluster does not come up
                raise
        return self

    def _peer_options(self, name: str) -> dict:
        """Engine options of one peer. A disk tier is per peer (its index is not shared): peer X uses
        ``<disk_cache_path>/X``, seeded on first start with a copy of what ``nebula-engine prefill`` wrote to
        ``<disk_cache_path>`` itself, so every peer starts warm."""
        options = dict(self.engine_options)
        root = options.get("disk_cache_path")
        if root:
            own = Path(root) / name
            if not own.exists() and (Path(root) / "index.json").exists():
                shutil.copytree(root, own, ignore=lambda directory, names: [
                    n for n in names if Path(directory) == Path(root) and (Path(root) / n).is_dir()])
            options["disk_cache_path"] = str(own)
        return options

    def _spawn(self, name: str, spec_file: Path) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        self._log_starts[name] = log.tell()  # a restarted peer's earlier output is not its reason to exit
        command = [sys.executable, "-m", "nebula_engine.cluster.runtime.peer", "--spec", str(spec_file), "--name", name,
                   "--model", self.model, "--served-model-name", self.served_model_name,
                   "--engine-options", json.dumps(self._peer_options(name)), "--log-level", self.log_level,
                   *self._settings_args()]
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self._peer_env())

    def _settings_args(self) -> list[str]:
        settings, access = self.settings, self.settings.etcd_access
        args = ["--peer-timeout", str(settings.peer_timeout_s), "--failover-timeout", str(settings.failover_timeout_s),
                "--max-request-bytes", str(settings.max_request_bytes)]
        for flag, value in (("--etcd-ca-cert", access.ca_cert), ("--etcd-cert", access.cert),
                            ("--etcd-key", access.key), ("--etcd-user", access.user)):
            if value is not None:
                args += [flag, value]
        return args

    def _peer_env(self) -> dict[str, str]:
        """The secrets travel in the environment (only this user and root can read /proc/PID/environ)."""
        env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, API_KEY_ENV, ETCD_PASSWORD_ENV)}
        secrets = {SECRET_ENV: self.settings.cluster_secret, API_KEY_ENV: self.settings.api_key,
                   ETCD_PASSWORD_ENV: self.settings.etcd_access.password}
        threads = {} if self.torch_threads is None else {"OMP_NUM_THREADS": str(self.torch_threads),
                                                          "MKL_NUM_THREADS": str(self.torch_threads)}
        ucx = {} if self.port_range is None or UCX_PORT_RANGE_ENV in env else {UCX_PORT_RANGE_ENV: str(self.port_range)}
        return {**env, **{k: v for k, v in secrets.items() if v}, **threads, **ucx, "PYTHONUNBUFFERED": "1"}

    def restart(self, name: str, timeout: float = 180.0) -> None:
        self.stop_peer(name, kill=True)
        self._spawn(name, Path(self._tmp.name) / "cluster.json")
        self.wait_until(lambda: self.state(name).get("leader") is not None, timeout, f"{name} to rejoin")

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Every running peer answers /health (it knows a leader) and all agree on the leader."""
        def ready() -> bool:
            for name in self.processes:  # every peer, before any is asked: one still starting must not hide an exit
                if self.processes[name].poll() is not None:
                    self._raise_exited(name)
            leaders = set()
            for name in self.processes:
                state = self.state(name)
                if not state.get("leader"):
                    return False
                leaders.add(state["leader"])
            return len(leaders) == 1 and next(iter(leaders)) in self.processes
        self.wait_until(ready, timeout, "the cluster to be ready")

    def _raise_exited(self, name: str) -> None:
        """PortTaken when peer ``name`` exited because a port of its was taken (and not a kept HTTP port), else
        RuntimeError; both name its log."""
        code, log = self.processes[name].returncode, self.log_dir / f"{name}.log"
        message = f"peer {name} exited with {code}; see {log}"
        try:
            output = log.read_bytes()[self._log_starts.get(name, 0):][-4096:].lower()
        except OSError:
            output = b""
        taken = code == PORT_TAKEN_EXIT or PORT_TAKEN_LOG in output
        # the peer's own check names the field; uvicorn, which binds only the HTTP port, says where it binds
        http_taken = b"another http_port" in output or b"error while attempting to bind" in output
        if taken and not (self.keep_http_ports and http_taken):
            raise PortTaken(message)
        raise RuntimeError(message)

    def state(self, name: str) -> dict:
        """GET /cluster of one peer ({} while it does not answer), with the API key when the cluster has one."""
        key = self.settings.api_key
        request = urllib.request.Request(self.urls[name] + "/cluster",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return json.loads(response.read())
        except OSError:
            return {}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, all threads) each running peer process has used so far; {} where the system
        has no ``/proc`` (Linux only)."""
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        used = {}
        for name, process in self.processes.items():
            try:
                stat = Path(f"/proc/{process.pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
            used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime and stime (fields 14 and 15)
        return used

    def leader(self) -> str:
        for name in self.processes:
            state = self.state(name)
            if state.get("leader"):
                return state["leader"]
        raise RuntimeError("no peer knows a leader")

    def wait_until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {self.log_dir}")
            time.sleep(0.2)

    def stop_peer(self, name: str, kill: bool = False) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def _stop_peers(self) -> None:
        for name in list(self.processes):
            self.stop_peer(name)

    def stop(self) -> None:
        self._stop_peers()
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
