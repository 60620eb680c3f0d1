"""Cluster lifecycles on 127.0.0.1, each test with its own cluster: failover, etcd election, warm start.

Kept apart from test_cluster_e2e so that no other cluster shares the two CPU cores while peers are killed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from nebula_engine.cluster.runtime.launcher import LocalCluster, PortTaken, local_spec, with_new_ports
from nebula_engine.cluster.runtime.spec import PeerSettings
from nebula_engine.cluster.runtime.transfer import nixl_available
from tests.cluster.test_cluster_e2e import ENGINE, completion, documents, post, rag_segments
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))


@pytest.fixture
def failover_cluster(model_dir, tmp_path):
    """3 prefill + 2 decode peers: a majority survives losing two of them."""
    with LocalCluster(model_dir, local_spec(3, 2), ENGINE, log_dir=tmp_path / "logs") as running:
        yield running


def run_concurrently(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    results: list = [None] * len(bodies)

    def one(i: int) -> None:
        try:
            results[i] = post(url, "/v1/completions", bodies[i], timeout=180)
        except Exception as error:  # noqa: BLE001  (reported by the assertion below)
            results[i] = (None, {"exception": repr(error)})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    return results, threads


def test_losing_a_prefill_peer_and_then_the_leader_loses_no_request(failover_cluster, model_dir, tmp_path):
    cluster = failover_cluster
    leader = cluster.leader()
    victim = next(p for p in ("prefill-0", "prefill-1", "prefill-2") if p != leader)
    front = next(p for p in cluster.urls if p not in (leader, victim))
    bodies = [completion(model_dir, rag_segments([31 + i] * 8, documents(100 + i, 3), [40, 41]),
                         max_tokens=12, **({"prefill_peer": victim} if i % 2 else {})) for i in range(8)]
    results, threads = run_concurrently(cluster.urls[front], bodies)
    cluster.stop_peer(victim, kill=True)  # mid-run: some requests were planned on it
    for thread in threads:
        thread.join()
    assert [status for status, _ in results] == [200] * 8, results
    assert all(body["usage"]["completion_tokens"] == 12 for _, body in results)
    # the leader notices the silence (3 s) even when every request finished before that
    cluster.wait_until(lambda: victim in cluster.state(leader).get("router", {}).get("dead", []), 30,
                       "the victim to be declared dead")

    cluster.stop_peer(leader, kill=True)
    cluster.wait_ready(timeout=60)
    new_leader = cluster.leader()
    assert new_leader not in (leader, victim)
    results, threads = run_concurrently(cluster.urls[front], bodies[:3])
    for thread in threads:
        thread.join()
    assert [status for status, _ in results] == [200] * 3, results


def test_a_cluster_can_elect_its_leader_through_etcd(model_dir, etcd_endpoint, tmp_path):
    spec = local_spec(1, 1, etcd=etcd_endpoint)
    with LocalCluster(model_dir, spec, ENGINE, log_dir=tmp_path / "logs") as cluster:
        leader = cluster.leader()
        assert leader in cluster.urls
        status, body = post(cluster.urls["decode-0"], "/v1/completions",
                            {"model": model_dir, "prompt": "a <pic>b c d</pic> e", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_a_cluster_starts_warm_from_an_offline_prefilled_corpus(model_dir, tmp_path):
    from nebula_engine.engine.offline_prefill import OfflinePrefill, build_prefill_engine

    docs = documents(seed=7, count=3, length=20)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"token_ids": d}) + "\n" for d in docs))
    disk = tmp_path / "disk"
    prefill = OfflinePrefill(build_prefill_engine(model_dir, disk, **ENGINE))
    try:
        assert prefill.run(corpus).prefilled == 3
    finally:
        prefill.close()
    options = {**ENGINE, "disk_cache_path": str(disk), "disk_cache_tokens": 100_000}
    with LocalCluster(model_dir, local_spec(1, 0), options, log_dir=tmp_path / "logs") as cluster:
        status, body = post(cluster.urls["prefill-0"], "/v1/completions",
                            completion(model_dir, rag_segments([51] * 8, docs, [52, 53])))
        assert status == 200, body
        assert body["usage"]["nebula"]["pic_cached_tokens"] == 60
        assert cluster.state("prefill-0")["pic"]["segment_misses"] == 0  # all three came from the disk tier


@dataclass
class Stream:
    """One streaming completion read on its own thread: the text deltas, the last chunk, how it ended."""

    url: str
    body: dict
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, stall_timeout_s: float = 60.0) -> Stream:
        threading.Thread(target=self._read, args=(stall_timeout_s,), daemon=True).start()
        return self

    def _read(self, stall_timeout_s: float) -> None:
        body = {**self.body, "stream": True, "stream_options": {"include_usage": True}}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=stall_timeout_s) as response:  # a stall is a hang
                for line in response:
                    self._on_line(line.decode().strip())
        except Exception as error:  # noqa: BLE001  (reported by the test's assertions)
            self.error = self.error or repr(error)
        finally:
            self.done.set()

    def _on_line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            self.error = chunk["error"]["message"]
        for choice in chunk.get("choices") or []:
            self.pieces.append(choice["text"])
            self.finish_reason = choice["finish_reason"] or self.finish_reason
        self.usage = chunk.get("usage") or self.usage


# long enough that a stream is still decoding when its peer is killed (the kill follows its 3rd piece at once; the
# test asserts none ended before it), short enough not to spend CI minutes decoding
LONG_TOKENS = 400


def wait_streaming(streams: list[Stream], pieces: int, cluster: LocalCluster) -> None:
    cluster.wait_until(lambda: all(len(s.pieces) >= pieces or s.done.is_set() for s in streams), 120,
                       f"every stream to show {pieces} pieces")


def test_requests_survive_losing_their_decode_peer(model_dir, tmp_path):
    """Requests decoding on decode-0 when it is killed continue elsewhere from the tokens they streamed. Then, for
    ~3 s after it died, the router still picks decode-0: new requests it hands off there are run again too."""
    with LocalCluster(model_dir, local_spec(2, 2), ENGINE, log_dir=tmp_path / "logs") as cluster:
        long = [completion(model_dir, rag_segments([81 + i] * 8, documents(300 + i, 2), [82]), max_tokens=LONG_TOKENS)
                for i in range(3)]
        streams = [Stream(cluster.urls["prefill-1"], body).start() for body in long]
        wait_streaming(streams, 3, cluster)
        assert not any(s.done.is_set() for s in streams), "the streams ended before the kill: make them longer"
        cluster.stop_peer("decode-0", kill=True)
        bodies = [completion(model_dir, rag_segments([61 + i] * 8, documents(200 + i, 2), [62]), max_tokens=5)
                  for i in range(3)]
        results, threads = run_concurrently(cluster.urls["prefill-1"], bodies)
        for thread in threads:
            thread.join()
        for stream in streams:
            assert stream.done.wait(180), "a stream hangs"
        assert [status for status, _ in results] == [200] * 3, results
        assert all(body["usage"]["completion_tokens"] == 5 for _, body in results)
        for stream in streams:
            assert stream.error is None and stream.finish_reason == "length", stream
            assert stream.usage["completion_tokens"] == LONG_TOKENS  # counted over every attempt: none lost or doubled
        assert cluster.state("prefill-1")["resubmitted"] >= 3


def test_a_peer_cut_off_from_the_majority_says_so_and_fails_requests_fast(model_dir, tmp_path):
    """2 of 3 peers die (the leader among them): the survivor stops naming a leader, /health answers 503, a new
    request fails at once, and a stream it was relaying from a dead peer ends with an error, not a hang."""
    with LocalCluster(model_dir, local_spec(2, 1), ENGINE, log_dir=tmp_path / "logs") as cluster:
        leader = cluster.leader()
        survivor = next(name for name in cluster.urls if name != leader)
        other = next(name for name in cluster.urls if name not in (leader, survivor))
        url = cluster.urls[survivor]
        body = completion(model_dir, rag_segments([91] * 8, documents(400, 2), [92]), max_tokens=1500,
                          prefill_peer=leader if leader.startswith("prefill") else other)
        stream = Stream(url, body).start()
        wait_streaming([stream], 3, cluster)
        cluster.stop_peer(leader, kill=True)
        cluster.stop_peer(other, kill=True)
        cluster.wait_until(lambda: health(url) == 503, 30, f"{survivor} to report itself unhealthy")
        started = time.monotonic()
        status, error = post(url, "/v1/completions", {"model": model_dir, "prompt": "hello", "max_tokens": 2},
                             timeout=30)
        assert status == 503 and "majority" in error["error"]["message"], error
        assert time.monotonic() - started < PeerSettings().failover_timeout_s  # refused, not waited out
        assert stream.done.wait(60), "the stream from a dead peer hangs"
        assert stream.error is not None and stream.finish_reason is None
        assert cluster.state(survivor)["leader"] is None and cluster.state(survivor)["quorum"] is False


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def test_a_port_taken_after_it_was_drawn_restarts_the_cluster_on_new_ports(model_dir, tmp_path):
    """Another process binds one of the drawn ports before the peer does (as when a decode peer's HTTP bind finds
    its port in use). The peer exits at once (``PORT_TAKEN_EXIT``) and the cluster starts
    again on newly drawn ports; with the HTTP ports kept (a user's ``--port``), a taken one is an error."""
    spec = local_spec(1, 1)
    taken = spec.peers[1].http_port
    with socket.socket() as squatter:
        squatter.bind((spec.peers[1].api_host, taken))
        squatter.listen()
        with LocalCluster(model_dir, spec, ENGINE, log_dir=tmp_path / "logs") as cluster:
            assert cluster.spec.peers[1].http_port != taken
            assert {p.name for p in cluster.spec.peers} == {p.name for p in spec.peers}
            assert post(cluster.urls["decode-0"], "/v1/completions",
                        completion(model_dir, rag_segments([31] * 8, documents(7, 2), [40]), max_tokens=2))[0] == 200
        assert b"already in use" in (tmp_path / "logs" / "decode-0.log").read_bytes()
        kept = LocalCluster(model_dir, spec, ENGINE, log_dir=tmp_path / "kept", keep_http_ports=True)
        with pytest.raises(RuntimeError, match="decode-0 exited with 75") as raised:
            kept.start()
        assert not isinstance(raised.value, PortTaken) and not kept.processes


def test_new_ports_are_drawn_for_every_listener_but_kept_http_ports():
    spec = local_spec(2, 1)
    redrawn = with_new_ports(spec, keep_http=False)
    old = {port for p in spec.peers for port in (p.ctrl_port, p.raft_port, p.http_port)}
    new = [port for p in redrawn.peers for port in (p.ctrl_port, p.raft_port, p.http_port)]
    assert len(set(new)) == len(new) == 9 and [p.name for p in redrawn.peers] == [p.name for p in spec.peers]
    assert len(old & set(new)) < 3  # drawn afresh (a few may repeat by chance)
    kept = with_new_ports(spec, keep_http=True)
    assert [p.http_port for p in kept.peers] == [p.http_port for p in spec.peers]
    assert not {p.http_port for p in spec.peers} & {port for p in kept.peers for port in (p.ctrl_port, p.raft_port)}
