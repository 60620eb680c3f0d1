"""A real cluster on 127.0.0.1: one process per peer, tiny model, NIXL between peers, Raft election.

One cluster for the module (with an API key): PIC reuse across peers, bad input, and the cluster as an outsider on
the network sees it (only loopback listeners, nothing unpickled, forged control messages dropped quietly).
Processes are started by ``LocalCluster`` and stopped by it (by pid) in the fixtures' finalizers.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq

from nebula_engine import LLM
from nebula_engine.cluster.runtime import wire
from nebula_engine.cluster.runtime.auth import FrameSealer, new_secret
from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec
from nebula_engine.cluster.runtime.spec import PeerSettings
from nebula_engine.cluster.runtime.transfer import nixl_available
from nebula_engine.engine.sampling_params import SamplingParams
from tests.cluster.probes import listening_sockets, payloads, send_to_all
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

ENGINE = {"page_size": 4, "num_pages": 1024}
MAX_TOKENS = 6
API_KEY = "test-api-key-0123456789"
MAX_REQUEST_BYTES = 64 * 1024  # far above every request these tests send


def post(url: str, path: str, body: dict | None, timeout: float = 120.0, key: str | None = API_KEY
         ) -> tuple[int, dict]:
    """POST ``body`` (GET when None) with the API key (a cluster without one ignores it); (status, JSON body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if path.startswith("/v1/") else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def remote_reads_on_metrics(url: str, kind: str, model_name: str) -> tuple[float, float]:
    """(tokens, bytes) of ``kind`` that ``/metrics`` says this peer read from others."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.labels == {"model_name": model_name, "kind": kind}}
    return found["nebula:kv_remote_read_tokens_total"], found["nebula:kv_remote_read_bytes_total"]


def documents(seed: int, count: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(length)] for _ in range(count)]


def rag_segments(system: list[int], docs: list[list[int]], question: list[int]) -> list[dict]:
    return ([{"kind": "regular", "token_ids": system}] + [{"kind": "pic", "token_ids": d} for d in docs]
            + [{"kind": "regular", "token_ids": question}])


def completion(model: str, segments: list[dict], **extra) -> dict:
    return {"model": model, "prompt": [t for s in segments for t in s["token_ids"]], "segments": segments,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return str(checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"]))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """2 prefill + 1 decode peers, nebula policy, an API key, a small request-body limit."""
    # no fixed cost on remote reads, and none learnt from the reads: the tiny model's segments are planned where they
    # are (the data plane under test); whether a read pays for itself is the planner's decision, tested in
    # test_policies / test_planner / test_router
    spec = local_spec(2, 1, remote_read_latency_s=0.0, scatter_dispatch_s=0.0, shared_cores=False,
                      observe_transfer_costs=False)
    with LocalCluster(model_dir, spec, ENGINE, log_dir=tmp_path_factory.mktemp("logs"),
                      settings=PeerSettings(api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES)) as running:
        yield running


def test_segment_cached_on_one_peer_is_reused_on_another_via_nixl(cluster, model_dir):
    system_a, system_b, question = [11] * 8, [12] * 8, [13, 14, 15, 16, 17]
    docs = documents(seed=1, count=3)
    url = cluster.urls["decode-0"]  # any peer is a front end
    first = completion(model_dir, rag_segments(system_a, docs, question), prefill_peer="prefill-0")
    status, body = post(url, "/v1/completions", first)
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # its segments were prefilled for it
    state_before = cluster.state("prefill-1")
    before, leads_before = state_before["transfer_bytes"], state_before["lead_tokens_prefilled"]
    permuted = rag_segments(system_b, docs[::-1], question)
    status, remote = post(url, "/v1/completions", completion(model_dir, permuted, prefill_peer="prefill-1"))
    assert status == 200, remote
    state_after = cluster.state("prefill-1")
    assert state_after["transfer_bytes"] > before  # the segments came from prefill-0
    assert remote["usage"]["nebula"]["pic_cached_tokens"] == 72
    # the three documents' tokens were read as PIC segments; /metrics says so with the served model's name
    assert state_after["read_tokens"]["pic"] - state_before["read_tokens"].get("pic", 0) == 72
    assert remote_reads_on_metrics(cluster.urls["prefill-1"], "pic", model_dir) == (
        state_after["read_tokens"]["pic"], state_after["read_bytes"]["pic"])
    # read from KV that existed before and not recomputed; the new system prompt, prefilled while the reads ran,
    # is no hit
    recomputed = remote["usage"]["nebula"]["recomputed_tokens"]
    assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == 72 - recomputed
    assert cluster.state("prefill-1")["lead_tokens_prefilled"] - leads_before == len(system_b)
    assert cluster.state("prefill-1")["pic"]["segment_misses"] == 0

    # the same two requests on one engine: local reuse gives the same tokens
    llm = LLM(model_dir, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    to_pairs = lambda segments: [(s["kind"], s["token_ids"]) for s in segments]  # noqa: E731
    llm.generate({"segments": to_pairs(first["segments"])}, params)
    local = llm.generate({"segments": to_pairs(permuted)}, params)[0]
    assert local.num_pic_cached_tokens == 72
    assert remote["choices"][0]["text"] == local.outputs[0].text


def test_the_leader_times_its_prefill_again_once_every_peer_has_started_and_nothing_is_in_flight(cluster):
    leader = cluster.state("decode-0")["leader"]
    cluster.wait_until(lambda: cluster.state(leader)["router"]["idle_prefill_timings"] >= 2, 60,
                       "two idle prefill timings on the leader")
    assert cluster.state(leader)["router"]["prefill_ms_per_token"] > 0
    assert all(cluster.state(name)["router"]["idle_prefill_timings"] == 0 for name in cluster.urls if name != leader)


@pytest.mark.parametrize("prefill_peer", ["prefill-0", None], ids=["pinned", "routed"])
def test_pic_off_request_after_a_pic_one_returns_plain_greedy_tokens(cluster, model_dir, prefill_peer):
    """KV provenance across the cluster: the blended K/V a PIC request leaves in a peer's prefix cache never
    answers a PIC-off request with the same prompt, on that peer (pinned) or wherever the router sends it."""
    seed = 3 if prefill_peer else 4
    segments = rag_segments([31 + seed] * 8, documents(seed=seed, count=3), [32, 33, 34, 35, 36])
    pinned = {"prefill_peer": prefill_peer} if prefill_peer else {}
    url = cluster.urls["decode-0"]
    status, body = post(url, "/v1/completions", completion(model_dir, segments, pic_backend="naive", **pinned))
    assert status == 200, body
    assert body["usage"]["nebula"]["pic_cached_tokens"] == 72 and body["usage"]["nebula"]["recomputed_tokens"] == 0
    status, exact = post(url, "/v1/completions", completion(model_dir, segments, pic_backend=None, **pinned))
    assert status == 200, exact
    assert exact["usage"]["nebula"].get("pic_cached_tokens", 0) == 0  # PIC detail fields only where PIC ran
    assert exact["usage"]["nebula"]["prefix_cached_tokens"] <= 8  # at most the exact system prompt's pages

    plain = LLM(model_dir, enable_prefix_caching=False, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = plain.generate({"prompt_token_ids": [t for s in segments for t in s["token_ids"]]}, params,
                               pic_backend=None)[0]
    assert exact["choices"][0]["text"] == reference.outputs[0].text


def test_cold_segments_of_one_request_are_prefilled_on_several_peers(cluster, model_dir):
    misses = {name: cluster.state(name)["pic"]["segment_misses"] for name in ("prefill-0", "prefill-1")}
    leads = {name: cluster.state(name)["lead_tokens_prefilled"] for name in misses}
    docs = documents(seed=2, count=6, length=40)
    status, body = post(cluster.urls["prefill-1"], "/v1/completions",
                        completion(model_dir, rag_segments([21] * 8, docs, [22, 23, 24])))
    assert status == 200, body
    grown = {name: cluster.state(name)["pic"]["segment_misses"] - misses[name] for name in misses}
    assert sum(grown.values()) == 6 and all(count > 0 for count in grown.values()), grown
    assert body["usage"]["nebula"]["pic_cached_tokens"] == 240
    # the combine reused the scattered segments and the system prompt its home prefilled while it waited, but they
    # were prefilled for this request: no cache hit
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sum(cluster.state(name)["lead_tokens_prefilled"] - leads[name] for name in misses) == 8


def test_a_prefix_cached_on_one_peer_is_read_over_nixl_by_a_combine_on_another(cluster, model_dir):
    """The planner may put the combine away from the prefix holder: the home reads the prefix's pages (it does
    not recompute them), and the answer is the one the holder itself gives."""
    system, docs = [31] * 16, documents(seed=3, count=3)
    # `full` recomputes every reused token, so the holder's prefix pages are exact over the documents too: a
    # prefix read carries exact KV only (an approximate combine's pages never serve as another's prefix)
    status, body = post(cluster.urls["decode-0"], "/v1/completions",
                        completion(model_dir, rag_segments(system, docs, [32, 33]), prefill_peer="prefill-0",
                                   pic_backend="full"))
    assert status == 200, body
    before = cluster.state("prefill-1")["transfer_bytes"]
    follow_up = rag_segments(system, docs, [34, 35, 36])
    status, remote = post(cluster.urls["decode-0"], "/v1/completions",
                          completion(model_dir, follow_up, prefill_peer="prefill-1"))
    assert status == 200, remote
    moved = cluster.state("prefill-1")["transfer_bytes"] - before
    assert moved > 0
    prefix_tokens = len(system) + 24 * len(docs)  # every page of the system prompt and the documents
    assert remote["usage"]["nebula"]["prefix_cached_tokens"] == prefix_tokens
    assert remote["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix_tokens
    status, local = post(cluster.urls["decode-0"], "/v1/completions",
                         completion(model_dir, follow_up, prefill_peer="prefill-0"))
    assert status == 200, local
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]


def test_openai_client_streams_a_chat_with_pic_tags(cluster, model_dir):
    import openai

    client = openai.OpenAI(base_url=cluster.urls["prefill-1"] + "/v1", api_key=API_KEY)
    stream = client.chat.completions.create(
        model=model_dir, stream=True, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": "Read <pic>the owl document</pic> and <pic>the cat one</pic>. Owls?"}])
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) >= 2 and "".join(pieces)


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "hi", "max_tokens": 2}, "model"),
    ({"model": "nope", "prompt": "hi"}, "model"),
    ({"model": "M", "prompt": "a <pic>unclosed"}, "unclosed <pic>"),
    ({"model": "M", "prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ({"model": "M", "prompt": "hi", "prefill_peer": "prefill-9"}, "prefill_peer"),
    ({"model": "M", "prompt": "hi", "pic_backend": "bogus"}, "unknown PIC backend"),
])
def test_bad_input_gets_a_400_and_the_cluster_keeps_serving(cluster, model_dir, body, needle):
    body = {k: (model_dir if v == "M" else v) for k, v in body.items()}
    status, error = post(cluster.urls["prefill-0"], "/v1/completions", body)
    unknown_model = body.get("model") == "nope"  # OpenAI's and vLLM's 404 model_not_found
    assert status == (404 if unknown_model else 400) and needle in error["error"]["message"], error
    status, ok = post(cluster.urls["prefill-0"], "/v1/completions",
                      {"model": model_dir, "prompt": "hello there", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def serves(cluster: LocalCluster, model: str, peer: str = "prefill-0") -> bool:
    status, body = post(cluster.urls[peer], "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2})
    return status == 200 and body["usage"]["completion_tokens"] == 2


def test_every_listener_of_every_peer_is_on_loopback(cluster):
    for name, process in cluster.processes.items():
        sockets = listening_sockets(process.pid)
        peer = cluster.spec.peer(name)
        assert {peer.ctrl_port, peer.raft_port, peer.http_port} <= {port for _, port in sockets}
        assert len(sockets) >= 4, sockets  # HTTP, control, Raft and UCX's own
        assert all(address == "127.0.0.1" for address, _ in sockets), (name, sockets)


def test_secrets_are_not_on_any_command_line(cluster):
    for process in cluster.processes.values():
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert cluster.settings.cluster_secret.encode() not in command_line
        assert API_KEY.encode() not in command_line
        assert cluster.settings.cluster_secret.encode() in Path(f"/proc/{process.pid}/environ").read_bytes()


def test_a_pickle_sent_to_every_listening_port_runs_nothing(cluster, model_dir, tmp_path):
    marker = tmp_path / "ran"
    ports = {port for process in cluster.processes.values() for _, port in listening_sockets(process.pid)}
    send_to_all("127.0.0.1", sorted(ports), payloads(marker, "127.0.0.1"))
    assert not marker.exists()
    assert all(process.poll() is None for process in cluster.processes.values())
    assert serves(cluster, model_dir)


def test_forged_control_messages_are_dropped_with_a_line_per_reason(cluster, model_dir):
    target = cluster.spec.peer("prefill-0")
    assert "prefill-1" in cluster.state("prefill-0")["nixl_peers"]
    log = cluster.log_dir / "prefill-0.log"
    log_size = log.stat().st_size
    dropped = cluster.state("prefill-0")["dropped_frames"]
    forged = wire.encode(wire.Hello(sender="prefill-1", role="prefill", worker_index=1, nixl_metadata=b"junk"))
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 2000)
        socket.connect(target.ctrl_address)
        for _ in range(100):
            socket.send(forged)  # unsealed
            socket.send(FrameSealer("prefill-1", new_secret()).seal("prefill-0", forged))  # another secret
            socket.send(b"\x93\x01\x02")  # garbage
        socket.close()
    finally:
        context.term()
    cluster.wait_until(lambda: cluster.state("prefill-0")["dropped_frames"] >= dropped + 300, 30,
                       "prefill-0 to drop the forged frames")
    assert "prefill-1" in cluster.state("prefill-0")["nixl_peers"]
    grown = log.read_text(errors="replace")[log_size:]
    assert "Traceback" not in grown and len(grown) < 2000, grown
    # the peer prefill-0 still reads KV from prefill-1: a segment cached there is reused on prefill-0
    system, docs = [71] * 8, documents(seed=70, count=2)
    status, _ = post(cluster.urls["decode-0"], "/v1/completions",
                     completion(model_dir, rag_segments(system, docs, [72]), prefill_peer="prefill-1"))
    assert status == 200
    before = cluster.state("prefill-0")["transfer_bytes"]
    status, body = post(cluster.urls["decode-0"], "/v1/completions",
                        completion(model_dir, rag_segments([73] * 8, docs, [72]), prefill_peer="prefill-0"))
    assert status == 200 and body["usage"]["nebula"]["pic_cached_tokens"] == 48
    assert cluster.state("prefill-0")["transfer_bytes"] > before


def test_every_peer_refuses_a_body_over_the_limit_with_413(cluster, model_dir):
    body = {"model": model_dir, "prompt": "x" * MAX_REQUEST_BYTES, "max_tokens": 2}
    for name, url in cluster.urls.items():
        status, error = post(url, "/v1/completions", body)
        assert status == 413, (name, status, error)
    assert serves(cluster, model_dir, "prefill-1")


def test_every_peer_wants_the_api_key_on_v1_but_not_on_health_and_metrics(cluster, model_dir):
    body = {"model": model_dir, "prompt": "hello", "max_tokens": 2}
    for name, url in cluster.urls.items():
        status, error = post(url, "/v1/completions", body, key=None)
        assert status == 401 and error["error"]["code"] == "invalid_api_key", (name, error)
        assert post(url, "/v1/models", None, key="wrong-key")[0] == 401
        assert post(url, "/health", None, key=None)[0] == 200
        assert post(url, "/metrics", None, key=None)[0] == 200
    assert serves(cluster, model_dir, "decode-0")


def test_a_hybrid_model_decodes_on_the_decode_peer_exactly_as_on_one_engine(checkpoint_factory, tmp_path):
    """Qwen3.5's linear-attention state after the prompt goes to the decode peer with its
    pages, so the decode peer continues it, and the tokens are a single engine's."""
    model = str(checkpoint_factory(CASES_BY_NAME["qwen3_5_linear_full_linear"]))
    prompt = documents(seed=9, count=1, length=37)[0]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with LocalCluster(model, local_spec(1, 1), ENGINE, log_dir=tmp_path / "logs") as cluster:
        status, handed = post(cluster.urls["prefill-0"], "/v1/completions", body, key=None)
        read = cluster.state("decode-0")["transfer_bytes"]
    assert status == 200, handed
    assert read > 0  # the decode peer read the prompt's pages: it decoded the request
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [local] = LLM(model, **ENGINE).generate({"prompt_token_ids": prompt}, params)
    assert handed["choices"][0]["text"] == local.outputs[0].text


def test_a_lead_prefilled_on_another_peer_is_read_by_the_home_and_answers_as_one_engine(cluster, model_dir):
    """A new system prompt (40 tokens, the request's largest piece) before one new document: the planner gives
    the lead to the peer that is not the home (each holds the same, empty, prefix), the home reads its pages and
    computes the document meanwhile. The lead's KV is exact, so the answer is one engine's; it was prefilled for
    this request, so it is no cache hit."""
    names = ("prefill-0", "prefill-1")
    before = {name: cluster.state(name) for name in names}
    segments = rag_segments(list(range(400, 440)), documents(seed=5, count=1), [41, 42, 43])
    status, body = post(cluster.urls["decode-0"], "/v1/completions", completion(model_dir, segments))
    assert status == 200, body
    after = {name: cluster.state(name) for name in names}
    grown = {name: after[name]["leads_for_others"] - before[name]["leads_for_others"] for name in names}
    assert sorted(grown.values()) == [0, 1], grown
    helper = next(name for name in names if grown[name])
    home = next(name for name in names if name != helper)
    assert after[helper]["lead_tokens_prefilled"] - before[helper]["lead_tokens_prefilled"] == 40
    assert after[home]["lead_tokens_prefilled"] == before[home]["lead_tokens_prefilled"]  # read, not prefilled
    assert after[home]["transfer_bytes"] > before[home]["transfer_bytes"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    llm = LLM(model_dir, **ENGINE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    local = llm.generate({"segments": [(s["kind"], s["token_ids"]) for s in segments]}, params)[0]
    assert body["choices"][0]["text"] == local.outputs[0].text
