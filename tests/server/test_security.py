"""The HTTP API's guards on a real uvicorn over a real engine: API key, body size limit, bounded and valid input
(numbers that would overflow inside an engine step are 400s while other streams complete), no internals in 500
bodies, and a large request tokenized off the event loop."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest

from nebula_engine import SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.engine.sampling_params import INT64_MAX, INT64_MIN, MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from nebula_engine.server.api import build_app
from nebula_engine.server.limits import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, ThreadedServer

API_KEY = "sk-test-0123456789"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    engine = AsyncLLMEngine.from_config(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def open_server(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME)).start()
    yield server
    server.stop()


@pytest.fixture()
def http(open_server):
    with httpx2.Client(base_url=open_server.url, timeout=60) as client:
        yield client


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}


def post_raw(http, path: str, raw: bytes):
    return http.post(path, content=raw, headers={"content-type": "application/json"})


# ---- API key ----

def test_api_key_guards_every_v1_route_and_leaves_health_and_metrics_open(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME, api_key=API_KEY)).start()
    try:
        keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        reply = keyed.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens <= 3
        assert [m.id for m in keyed.models.list()] == [MODEL_NAME]
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY + "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            wrong.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])

        with httpx2.Client(base_url=server.url, timeout=60) as http:
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/nothing")):
                response = http.request(method, path, json=body(prompt=PROMPT))
                assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
                assert response.json()["error"]["code"] == "invalid_api_key"
            for header in (f"Basic {API_KEY}", API_KEY, "Bearer", f"Bearer {API_KEY[:-1]}"):
                assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401, header
            assert http.get("/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
            assert http.get("/health").status_code == 200
            assert "nebula_requests_running" in http.get("/metrics").text
    finally:
        server.stop()


# ---- request size ----

@pytest.fixture(scope="module")
def small_limit_server(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME, max_request_bytes=2048)).start()
    yield server
    server.stop()


def raw_exchange(url: str, head: bytes, chunks: list[bytes]) -> bytes:
    """Send ``head`` and ``chunks`` on one connection and read the response (the server may close early)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head)
        for chunk in chunks:
            connection.sendall(chunk)
        received = b""
        while data := connection.recv(65536):
            received += data
    return received


def test_declared_oversize_body_is_a_413_before_any_byte_of_it_is_read(small_limit_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\nConnection: close\r\n\r\n")
    response = raw_exchange(small_limit_server.url, head, [])  # the body never comes: the answer must not wait
    status, _, payload = response.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413")
    error = json.loads(payload)["error"]
    assert error["code"] == "request_too_large" and "2048" in error["message"]


def test_chunked_body_over_the_limit_is_a_413(small_limit_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    piece = b'{"model": "' + b"x" * 1000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 3  # 3 kB, no Content-Length
    status, _, payload = raw_exchange(small_limit_server.url, head, chunks).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413") and json.loads(payload)["error"]["type"] == "invalid_request_error"


def test_bodies_within_the_limit_are_served_chunked_or_not(small_limit_server):
    payload = json.dumps(body(prompt=PROMPT, max_tokens=2)).encode()
    with httpx2.Client(base_url=small_limit_server.url, timeout=60) as http:
        assert http.post("/v1/completions", content=payload,
                         headers={"content-type": "application/json"}).status_code == 200
        chunked = http.post("/v1/completions", content=iter([payload[:10], payload[10:]]),
                            headers={"content-type": "application/json"})
        assert chunked.status_code == 200 and chunked.json()["usage"]["completion_tokens"] == 2


# ---- bounded, valid input ----

SURROGATE = "abc \ud800 def"
BAD_VALUES = [  # (fields, the param the 400 names)
    (dict(prompt=PROMPT, seed=18446744073709551616), "seed"),  # each overflows a step without the bounds
    (dict(prompt=PROMPT, top_k=9223372036854775808), "top_k"),
    (dict(prompt=SURROGATE), "prompt"),
    (dict(messages=[{"role": "user", "content": SURROGATE}]), "messages"),
    (dict(prompt=PROMPT, seed=INT64_MAX + 1), "seed"),
    (dict(prompt=PROMPT, seed=INT64_MIN - 1), "seed"),
    (dict(prompt=PROMPT, top_k=2 ** 31), "top_k"),
    (dict(prompt=PROMPT, top_k=-2), "top_k"),
    (dict(prompt=PROMPT, temperature=2.5), "temperature"),
    (dict(prompt=PROMPT, top_p=1.5), "top_p"),
    (dict(prompt=PROMPT, max_tokens=2 ** 70), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2 ** 64), "max_completion_tokens"),
    (dict(prompt=PROMPT, stop=["a"] * (MAX_STOP_SEQUENCES + 1)), "stop"),
    (dict(prompt=PROMPT, stop="x" * (MAX_STOP_CHARS + 1)), "stop"),
    (dict(prompt=PROMPT, stop=[""]), "stop"),
    (dict(prompt=PROMPT, stop=[SURROGATE]), "stop"),
    (dict(prompt=PROMPT, stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt=PROMPT, stop_token_ids=[2 ** 63]), "stop_token_ids"),
    (dict(prompt=PROMPT, stop_token_ids=[10 ** 9]), None),  # in int32, outside the vocabulary: the engine's check
    (dict(prompt=[5, -1]), "prompt"),
    (dict(prompt=[5, 2 ** 64]), "prompt"),
    (dict(segments=[{"kind": "pic", "token_ids": [2 ** 40]}]), "segments"),
    (dict(prompt=PROMPT, user=SURROGATE), "user"),
]


def send_bad(http, fields: dict):
    path = "/v1/chat/completions" if "messages" in fields else "/v1/completions"
    return post_raw(http, path, json.dumps(body(**fields)).encode())  # ASCII JSON: lone surrogates as escapes


@pytest.mark.parametrize("fields, param", BAD_VALUES, ids=[str(i) for i in range(len(BAD_VALUES))])
def test_out_of_range_and_invalid_text_are_400s_naming_the_field(http, fields, param):
    response = send_bad(http, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


@pytest.mark.parametrize("raw", [b'{"model": "tiny-qwen3", "prompt": "a", "temperature": NaN}',
                                 b'{"model": "tiny-qwen3", "prompt": "a", "top_p": Infinity}',
                                 b'{"model": "tiny-qwen3", "prompt": "caf\xe9"}',  # not UTF-8
                                 b'{"model": "tiny-qwen3", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_non_finite_numbers_bad_bytes_and_deep_nesting_are_400s(http, raw):
    response = post_raw(http, "/v1/completions", raw)
    assert response.status_code == 400 and response.json()["error"]["message"]


def test_overflow_inputs_are_400s_while_concurrent_streams_complete(open_server, reference_llm):
    """Unbounded, these would pass validation and overflow inside an engine step, failing every request in it."""
    prompts = ["Once upon a time", "1, 2, 3,", "Paged attention is"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]
    with httpx2.Client(base_url=open_server.url, timeout=60) as streams_client, \
            httpx2.Client(base_url=open_server.url, timeout=60) as http:
        with ThreadPoolExecutor(len(prompts)) as pool:
            started = [threading.Event() for _ in prompts]
            futures = [pool.submit(read_stream, streams_client, prompt, 48, event)
                       for prompt, event in zip(prompts, started)]
            assert all(event.wait(60) for event in started)  # every stream is live in the engine
            for fields, _ in BAD_VALUES:
                assert send_bad(http, fields).status_code == 400, fields
            texts = [future.result(timeout=120) for future in futures]
    assert texts == expected


def read_stream(http, prompt: str, max_tokens: int, started: threading.Event) -> str:
    text = ""
    with http.stream("POST", "/v1/completions", json=body(prompt=prompt, max_tokens=max_tokens, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            started.set()
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
    return text


# ---- what a client sees of a failure ----

def test_an_unexpected_error_is_a_500_naming_an_id_not_the_internals(engine, caplog):
    app = build_app(engine, MODEL_NAME)

    async def broken():
        raise RuntimeError("secret detail /srv/weights/key.txt")

    app.add_api_route("/v1/broken", broken)
    server = ThreadedServer(app).start()
    try:
        response = httpx2.get(f"{server.url}/v1/broken", timeout=30)
    finally:
        server.stop()
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "internal_server_error"
    assert "secret" not in response.text and "RuntimeError" not in response.text
    error_id = error["message"].split("(id ")[1].split(")")[0]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)


# ---- the event loop stays free ----

class _TokenizerWatch:
    """The engine's tokenizer, telling the test when ``segment_prompt`` starts and holding its result until the
    test has measured: the request is certainly in flight while /health is probed."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.started, self.release = threading.Event(), threading.Event()

    def segment_prompt(self, text: str):
        self.started.set()
        try:
            return self._tokenizer.segment_prompt(text)
        finally:
            self.release.wait(60)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class _WatchedClient:
    def __init__(self, engine: AsyncLLMEngine):
        self._engine = engine
        self.tokenizer = _TokenizerWatch(engine.tokenizer)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_health_answers_within_half_a_second_while_a_4_mb_prompt_is_tokenized(engine):
    client = _WatchedClient(engine)
    server = ThreadedServer(build_app(client, MODEL_NAME)).start()
    words = "The quick brown fox jumps over the lazy dog. 1234 "
    prompt = (words * (4_000_000 // len(words) + 1))[:4_000_000]
    payload = json.dumps(body(prompt=prompt)).encode()
    assert 4_000_000 < len(payload) <= DEFAULT_MAX_REQUEST_BYTES
    try:
        with ThreadPoolExecutor(1) as pool, httpx2.Client(base_url=server.url, timeout=10) as http:
            big = pool.submit(httpx2.post, f"{server.url}/v1/completions", content=payload,
                              headers={"content-type": "application/json"}, timeout=300)
            assert client.tokenizer.started.wait(120)
            latencies = []
            for _ in range(5):
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
            client.tokenizer.release.set()
            response = big.result(timeout=300)
    finally:
        client.tokenizer.release.set()
        server.stop()
    assert max(latencies) < 0.5, latencies  # tokenized inline, /health waited 6-15 s
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
