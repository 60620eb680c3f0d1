"""A cluster spread over "machines": each peer in its own Linux network namespace with its own address, joined
by veth pairs to a bridge (itself in a namespace of its own, so the host's network is never touched).

It elects a leader over the network, reuses a PIC segment across namespaces with a NIXL read (UCX over TCP only,
as between separate machines), checks each peer listens on its own address alone, then kills the decode peer
while requests decode on it and checks every request still ends. Needs root (CI runs as root); skips where
``ip netns`` is not allowed. Namespaces and processes are removed by their own names and pids, even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nebula_engine.cluster.runtime.auth import new_secret
from nebula_engine.cluster.runtime.spec import ClusterSpec, PeerSpec
from nebula_engine.cluster.runtime.transfer import nixl_available
from tests.cluster.probes import listening_sockets
from tests.cluster.test_cluster_e2e import ENGINE, completion, documents, rag_segments
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

SUBNET = "10.213.0"
PEERS = (("prefill-0", "prefill", 0, 10), ("prefill-1", "prefill", 1, 11), ("decode-0", "decode", -1, 12))
CLIENT_HOST = 100
PORTS = {"ctrl_port": 7001, "raft_port": 7002, "http_port": 8000}  # every peer has its own address: no clash

# Runs inside the client namespace: one HTTP call, prints {"status": ..., "body": ...}.
CLIENT_SCRIPT = """
import json, sys, urllib.error, urllib.request
url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
headers = {"Content-Type": "application/json"}
request = urllib.request.Request(url, data=body.encode() if body else None, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
        print(json.dumps({"status": response.status, "body": json.loads(response.read())}))
except urllib.error.HTTPError as error:
    print(json.dumps({"status": error.code, "body": json.loads(error.read() or b"{}")}))
except OSError as error:
    print(json.dumps({"status": 0, "body": {"error": repr(error)}}))
"""


class NetworkLab:
    """Namespaces named ``nbt<pid>-*``: one bridge, one per member; each member gets ``SUBNET.<host>/24`` on v0."""

    def __init__(self):
        self.prefix = f"nbt{os.getpid()}"
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.bridge = self._add_namespace("br")
        subprocess.run(["ip", "netns", "exec", self.bridge, "true"], check=True, capture_output=True, text=True)
        self._ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge, "link", "set", "br0", "up")

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _add_namespace(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        self._ip("netns", "add", name)
        self.namespaces.append(name)
        return name

    def add_member(self, suffix: str, host: int) -> str:
        namespace, port = self._add_namespace(suffix), f"p{host}"
        self._ip("link", "add", "v0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", self.bridge)
        self._ip("-n", namespace, "addr", "add", f"{SUBNET}.{host}/24", "dev", "v0")
        for device in ("v0", "lo"):
            self._ip("-n", namespace, "link", "set", device, "up")
        self._ip("-n", self.bridge, "link", "set", port, "master", "br0")
        self._ip("-n", self.bridge, "link", "set", port, "up")
        return namespace

    def spawn(self, namespace: str, argv: list[str], **popen) -> subprocess.Popen:
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], **popen)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


@pytest.fixture
def lab():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    try:
        network = NetworkLab()
    except subprocess.CalledProcessError as error:
        subprocess.run(["ip", "netns", "del", f"nbt{os.getpid()}-br"], capture_output=True)
        pytest.skip(f"network namespaces are not allowed here (`{' '.join(error.cmd)}` needs root and "
                    f"CAP_SYS_ADMIN): {error.stderr.strip()}")
    try:
        yield network
    finally:
        network.close()


class Cluster:
    """The peers of ``PEERS`` in their namespaces, and a client namespace to call their HTTP APIs from."""

    def __init__(self, lab: NetworkLab, model: str, log_dir: Path):
        self.lab, self.model = lab, model
        peers = tuple(PeerSpec(name, role, f"{SUBNET}.{host}", worker_index=index, **PORTS)
                      for name, role, index, host in PEERS)
        self.spec = ClusterSpec(peers, remote_read_latency_s=0.0, scatter_dispatch_s=0.0,  # every read planned
                                observe_transfer_costs=False)
        spec_file = log_dir / "cluster.json"
        spec_file.write_text(self.spec.to_json())
        self.client = lab.add_member("client", CLIENT_HOST)
        env = {**os.environ, "NEBULA_CLUSTER_SECRET": new_secret(), "PYTHONUNBUFFERED": "1",
               "UCX_TLS": "tcp,self"}  # as between machines: no shared memory between peers
        self.processes = {}
        for name, _, _, host in PEERS:
            namespace = lab.add_member(name, host)
            log = open(log_dir / f"{name}.log", "ab")
            self.processes[name] = lab.spawn(namespace, [
                sys.executable, "-m", "nebula_engine.cluster.runtime.peer", "--spec", str(spec_file), "--name", name,
                "--model", model, "--engine-options", json.dumps(ENGINE), "--log-level", "info"],
                stdout=log, stderr=subprocess.STDOUT, env=env)

    def call(self, peer: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        argv = [sys.executable, "-c", CLIENT_SCRIPT, self.spec.peer(peer).url + path,
                json.dumps(body) if body is not None else "", str(timeout)]
        done = subprocess.run(["ip", "netns", "exec", self.client, *argv], capture_output=True, text=True,
                              timeout=timeout + 60)
        reply = json.loads(done.stdout)
        return reply["status"], reply["body"]

    def state(self, peer: str) -> dict:
        status, body = self.call(peer, "/cluster", timeout=5)
        return body if status == 200 else {}

    def wait_until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for name, process in self.processes.items():
                assert process.poll() is None or name in self.killed, f"peer {name} exited"
            assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
            time.sleep(0.5)

    killed: set[str] = set()

    def leaders(self) -> set:
        return {self.state(name).get("leader") for name in self.processes if name not in self.killed}


def test_peers_on_separate_hosts_elect_share_kv_and_survive_losing_a_peer(lab, checkpoint_factory, tmp_path):
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))
    cluster = Cluster(lab, model, tmp_path)
    cluster.wait_until(lambda: len(leaders := cluster.leaders()) == 1 and None not in leaders, 300,
                       "the peers to agree on a leader over the network")

    for name, process in cluster.processes.items():  # each listens on its own address only
        address = cluster.spec.peer(name).host
        sockets = listening_sockets(process.pid)
        assert len(sockets) >= 4 and all(ip == address for ip, _ in sockets), (name, sockets)

    docs, question = documents(seed=5, count=3), [13, 14, 15]
    status, body = cluster.call("decode-0", "/v1/completions",
                                completion(model, rag_segments([11] * 8, docs, question), prefill_peer="prefill-0"))
    assert status == 200, body
    status, body = cluster.call("decode-0", "/v1/completions",
                                completion(model, rag_segments([12] * 8, docs[::-1], question),
                                           prefill_peer="prefill-1"))
    assert status == 200 and body["usage"]["nebula"]["pic_cached_tokens"] == 72, body
    assert cluster.state("prefill-1")["transfer_bytes"] > 0  # read from prefill-0's namespace over TCP

    bodies = [completion(model, rag_segments([20 + i] * 8, documents(30 + i, 2), question), max_tokens=800)
              for i in range(3)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        replies = [pool.submit(cluster.call, "prefill-0", "/v1/completions", body, 240) for body in bodies]
        cluster.wait_until(lambda: cluster.state("decode-0").get("engine", {}).get("running", 0) >= 1, 120,
                           "a request to decode on decode-0")
        cluster.killed.add("decode-0")
        cluster.processes["decode-0"].kill()
        cluster.processes["decode-0"].wait(timeout=10)
        results = [reply.result() for reply in replies]
    assert [status for status, _ in results] == [200] * 3, results
    assert all(body["usage"]["completion_tokens"] == 800 for _, body in results)
    status, body = cluster.call("prefill-1", "/v1/completions", completion(model, rag_segments([40] * 8, docs,
                                                                                                 question)))
    assert status == 200, body
