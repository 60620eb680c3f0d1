"""Trace replay against a small real aiohttp server speaking the OpenAI streaming completions API.

The server is deterministic: it streams ``max_tokens`` one-character chunks and a final usage chunk
whose ``cached_tokens`` is the number of PIC-segment tokens in the prompt, and it answers with a
configured HTTP status for configured prompt lengths (and 400 beyond its context length), or streams
only the usage chunk for configured lengths.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web
from click.testing import CliRunner

from nebula_engine.cli.bench import bench
from nebula_engine.bench.replay import (
    BenchError, PromptBuilder, ReplayOptions, ReplayResult, RequestRecord, poisson_offsets, replay,
)
from nebula_engine.bench.report import summarize
from nebula_engine.workloads.request import Request, Segment, SegmentKind

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 4096


class CompletionServer:
    """A real HTTP server on 127.0.0.1 with its own event loop thread."""

    def __init__(self, fail_statuses: dict[int, int] | None = None, tokenless_lengths: frozenset[int] = frozenset()):
        self.fail_statuses = fail_statuses or {}
        self.tokenless_lengths = tokenless_lengths
        self.bodies: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/completions", self.completions)])
        self._runner = web.AppRunner(app)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    async def _start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny-test", "object": "model", "vocab_size": VOCAB_SIZE, "max_model_len": MAX_MODEL_LEN}]})

    async def completions(self, http_request: web.Request) -> web.StreamResponse:
        body = await http_request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if prompt != [t for segment in body["segments"] for t in segment["token_ids"]]:
            return web.json_response({"error": "prompt is not the concatenated segments"}, status=400)
        if len(prompt) in self.fail_statuses:
            return web.json_response({"error": "configured failure"}, status=self.fail_statuses[len(prompt)])
        if len(prompt) + body["max_tokens"] > MAX_MODEL_LEN:
            return web.json_response({"error": "context length exceeded"}, status=400)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(http_request)
        for _ in range(0 if len(prompt) in self.tokenless_lengths else body["max_tokens"]):
            await reply.write(_event({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]}))
        cached = sum(len(s["token_ids"]) for s in body["segments"] if s["kind"] == "pic")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(prompt) + body["max_tokens"], "prompt_tokens_details": {"cached_tokens": cached}}
        await reply.write(_event({"object": "text_completion", "choices": [], "usage": usage}))
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply


def _event(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


@pytest.fixture
def server():
    started = CompletionServer()
    yield started
    started.close()


def segment(kind: str, content_id: str, num_tokens: int) -> Segment:
    return Segment(SegmentKind(kind), content_id, num_tokens)


def make_requests() -> list[Request]:
    """Four requests sharing a system prompt and two documents; lengths all distinct."""
    shapes = [
        (segment("prefix", "sys", 20), segment("pic", "doc-a", 30), segment("regular", "q1", 5)),
        (segment("prefix", "sys", 20), segment("pic", "doc-b", 40), segment("pic", "doc-a", 30),
         segment("regular", "q2", 6)),
        (segment("prefix", "sys", 20), segment("regular", "q3", 7)),
        (segment("prefix", "sys", 20), segment("pic", "doc-b", 40), segment("regular", "q4", 8)),
    ]
    return [Request(f"r{i}", 0.0, "s", segments, output_tokens=3) for i, segments in enumerate(shapes)]


def test_poisson_arrivals_are_seeded_ordered_and_have_the_requested_mean_gap():
    offsets = poisson_offsets(4000, qps=20.0, seed=7)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.1)
    assert offsets == poisson_offsets(4000, qps=20.0, seed=7)
    assert offsets != poisson_offsets(4000, qps=20.0, seed=8)
    with pytest.raises(BenchError, match="positive finite rate"):
        poisson_offsets(3, qps=0.0, seed=0)


def test_replay_sends_wire_segments_with_stable_token_ids(server):
    requests = make_requests()
    result = asyncio.run(replay(server.url, requests, qps=200.0))
    bodies = sorted(server.bodies, key=lambda b: len(b["prompt"]))
    by_length = {len(b["prompt"]): b for b in bodies}
    assert sorted(by_length) == sorted(r.num_tokens for r in requests)
    ids_of: dict[str, list[int]] = {}
    for request in requests:
        body = by_length[request.num_tokens]
        assert [s["kind"] for s in body["segments"]] == [
            "pic" if s.kind is SegmentKind.PIC else "regular" for s in request.segments]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "tiny-test" and body["max_tokens"] == 3
        for seg, wire in zip(request.segments, body["segments"]):
            assert all(100 <= t < VOCAB_SIZE for t in wire["token_ids"])  # the server's vocab, not 32000
            assert ids_of.setdefault(seg.content_id, wire["token_ids"]) == wire["token_ids"]
    assert ids_of["doc-a"] != ids_of["doc-b"]
    assert [r.request_id for r in result.records] == ["r0", "r1", "r2", "r3"]
    assert all(r.sent_s >= r.scheduled_s for r in result.records)  # never sent before its arrival time
    assert all(r.ok and r.ttft_s <= r.latency_s and r.completion_tokens == 3 for r in result.records)


def test_cache_hit_ratio_is_cached_over_prompt_tokens(server):
    requests = make_requests()
    summary = summarize(asyncio.run(replay(server.url, requests, qps=200.0)))
    pic_tokens = sum(s.num_tokens for r in requests for s in r.segments if s.kind is SegmentKind.PIC)
    assert summary["cached_tokens"] == pic_tokens == 30 + 70 + 40
    assert summary["prompt_tokens"] == sum(r.num_tokens for r in requests) == 55 + 96 + 27 + 68
    assert summary["cache_hit_ratio"] == pytest.approx(140 / 246)
    assert summary["completed"] == 4 and summary["failed"] == 0 and summary["requests_without_usage"] == 0


def test_server_errors_count_as_failures():
    server = CompletionServer(fail_statuses={96: 400, 27: 500}, tokenless_lengths=frozenset({68}))
    try:
        result = asyncio.run(replay(server.url, make_requests(), qps=200.0))
    finally:
        server.close()
    errors = {r.request_id: r.error for r in result.records}
    assert errors["r0"] is None
    assert errors["r1"].startswith("HTTP 400") and errors["r2"].startswith("HTTP 500")
    assert errors["r3"] == "stream ended before the first token"
    summary = summarize(result)
    assert (summary["completed"], summary["failed"]) == (1, 3)
    assert summary["prompt_tokens"] == 55  # failed requests do not enter CHR


def test_max_prompt_tokens_shrinks_prompts_but_keeps_segments_and_reuse(server):
    requests = make_requests()  # the longest has 96 tokens: one scale of 24/96 for the run
    asyncio.run(replay(server.url, requests, qps=200.0, options=ReplayOptions(max_prompt_tokens=24)))
    expected = {request.request_id: [max(1, s.num_tokens // 4) for s in request.segments] for request in requests}
    assert expected == {"r0": [5, 7, 1], "r1": [5, 10, 7, 1], "r2": [5, 1], "r3": [5, 10, 2]}
    by_length = {len(body["prompt"]): body for body in server.bodies}
    ids_of: dict[str, list[int]] = {}
    for request in requests:
        body = by_length[sum(expected[request.request_id])]
        assert [len(wire["token_ids"]) for wire in body["segments"]] == expected[request.request_id]
        for seg, wire in zip(request.segments, body["segments"]):
            assert ids_of.setdefault(seg.content_id, wire["token_ids"]) == wire["token_ids"]


def test_prompts_still_too_long_after_scaling_lose_their_tail():
    builder = PromptBuilder(vocab_size=1000, scale=0.1, max_prompt_tokens=3)
    request = Request("r", 0.0, "s", tuple(segment("pic", f"d{i}", 10) for i in range(5)))
    assert [len(wire["token_ids"]) for wire in builder.segments(request)] == [1, 1, 1]


def record(index: int, ttft: float | None, prompt: int = 10, cached: int | None = 5) -> RequestRecord:
    ok = ttft is not None
    return RequestRecord(index, f"r{index}", 0.0, 0.0, ttft, ttft + 0.5 if ok else None, prompt, cached,
                         1 if ok else 0, None if ok else "HTTP 500: boom")


def test_summary_arithmetic_on_known_records():
    records = [record(i, (i + 1) / 100) for i in range(100)] + [record(100, None), record(101, 0.2, cached=None)]
    result = ReplayResult("http://x", "m", qps=4.0, seed=0, vocab_size=1000, prompt_scale=1.0, duration_s=20.0,
                          records=tuple(records))
    summary = summarize(result, ttft_slo_s=0.5)
    ttfts = sorted([(i + 1) / 100 for i in range(100)] + [0.2])
    assert summary["ttft_p50_s"] == pytest.approx(ttfts[50])
    assert summary["ttft_p95_s"] == pytest.approx(ttfts[95])
    assert summary["ttft_p99_s"] == pytest.approx(ttfts[99])
    assert summary["latency_p50_s"] == pytest.approx(ttfts[50] + 0.5)
    assert (summary["completed"], summary["failed"]) == (101, 1)
    assert summary["errors"] == {"HTTP 500: boom": 1}
    assert summary["cache_hit_ratio"] == pytest.approx(500 / 1010)
    assert summary["requests_without_usage"] == 1
    assert summary["goodput_rps"] == pytest.approx(51 / 20.0)  # 0.01..0.50 and the 0.2
    assert summary["throughput_rps"] == pytest.approx(101 / 20.0)


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(BenchError, match="cannot list models"):
        asyncio.run(replay("http://127.0.0.1:9", make_requests(), qps=10.0))


def test_cli_replays_a_trace_and_writes_json_and_png(server, tmp_path):
    args = ["--url", server.url, "--trace", "ragpulse", "--qps", "100", "--num-requests", "4",
            "--max-prompt-tokens", "128", "--max-tokens", "2", "--out", str(tmp_path), "--label", "tiny"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    document = json.loads((tmp_path / "bench_tiny.json").read_text())
    assert document["summary"]["completed"] == 4
    assert (document["run"]["trace"], document["run"]["model"], document["run"]["vocab_size"]) == (
        "ragpulse", "tiny-test", VOCAB_SIZE)
    assert len(document["requests"]) == 4 and document["summary"]["prompt_scale"] < 1
    assert all(len(body["prompt"]) <= 128 for body in server.bodies)
    assert (tmp_path / "bench_tiny_ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "CHR" in outcome.output
