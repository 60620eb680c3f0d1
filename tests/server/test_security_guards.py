"""What an attacker or a careless client meets on a real uvicorn over a real engine: the API key on every route
but the probes', 5xx bodies without internals, 400s without code reprs, deadlines for slow clients (head, body,
idle keep-alive) and per-request cost caps that name the limit."""

from __future__ import annotations

import json
import logging
import socket

import httpx2
import pytest
import uvicorn

from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.server.api import build_app
from nebula_engine.cli.serve import _warn_if_unguarded
from nebula_engine.server.guards import header_timeout_protocol
from nebula_engine.server.limits import ClientLimits
from tests.server.conftest import MODEL_NAME, ThreadedServer

API_KEY = "sk-test-0123456789"
PROMPT = "The quick brown fox jumps over"


class GuardedServer(ThreadedServer):
    """``ThreadedServer`` with the head deadline and keep-alive settings ``serve`` gives uvicorn."""

    def __init__(self, app, header_timeout_s: float = 20.0, keep_alive_s: int = 5):
        super().__init__(app)
        self.config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=keep_alive_s,
                                     http=header_timeout_protocol(header_timeout_s))


@pytest.fixture(scope="module")
def engine(observed_engine):
    engine = AsyncLLMEngine(observed_engine)
    yield engine
    engine.shutdown()


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields}


def address(server: ThreadedServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(connection: socket.socket) -> bytes:
    received = b""
    while data := connection.recv(65536):
        received += data
    return received


# ---- the key covers every route but /health (and /metrics unless protected) ----

def test_the_api_key_guards_cluster_state_openapi_and_every_other_route(engine):
    app = build_app(engine, MODEL_NAME, api_key=API_KEY)
    app.add_api_route("/cluster", lambda: {"leader": "prefill-0", "quorum": True})  # what a peer adds
    server = ThreadedServer(app).start()
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx2.Client(base_url=server.url, timeout=60) as http:
            for path in ("/cluster", "/openapi.json", "/tokenize", "/v1/models", "/docs", "/anything"):
                response = http.get(path)
                assert response.status_code == 401, path
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert "leader" not in response.text and "openapi" not in response.text
            assert http.get("/cluster", headers=keyed).json()["leader"] == "prefill-0"
            assert http.get("/openapi.json", headers=keyed).json()["info"]["title"] == "nebula-engine"
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
    finally:
        server.stop()


def test_protected_metrics_need_the_key_and_health_stays_open(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME, api_key=API_KEY, open_metrics=False)).start()
    try:
        with httpx2.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/metrics").status_code == 401
            keyed = http.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
            assert "nebula_requests_running" in keyed.text
            assert http.get("/health").status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("192.168.1.7", True), ("example.org", True),
                                          ("127.0.0.1", False), ("::1", False), ("localhost", False)])
def test_serving_beyond_loopback_without_a_key_warns(capsys, host, warned):
    _warn_if_unguarded(host, None)
    _warn_if_unguarded(host, API_KEY)  # never with a key
    assert ("WARNING" in capsys.readouterr().err) == warned


# ---- what a failure shows ----

@pytest.fixture(scope="module")
def open_server(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME, limits=ClientLimits(
        max_request_output_tokens=12, max_request_prompt_tokens=40))).start()
    yield server
    server.stop()


def test_an_engine_failure_is_a_500_with_an_id_and_no_internals(open_server, observed_engine, caplog):
    observed_engine.fail_next_step()
    with caplog.at_level(logging.ERROR):
        response = httpx2.post(f"{open_server.url}/v1/completions", json=body(prompt=PROMPT, max_tokens=8),
                               timeout=60)
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "internal_server_error"
    assert "injected" not in response.text and "RuntimeError" not in response.text
    request_id = error["message"].split("(id ")[1].split(")")[0]
    assert request_id.startswith("cmpl-") and "retry" in error["message"]
    assert any(request_id in r.getMessage() and "injected device failure" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fields", [dict(stop=[None]), dict(stop={"role": "user"}), dict(stop=[["a"]])])
def test_validation_errors_name_the_field_and_no_code_object(open_server, fields):
    response = httpx2.post(f"{open_server.url}/v1/completions", json=body(prompt=PROMPT, **fields), timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "stop", error
    assert "0x" not in error["message"] and "function" not in error["message"] and "partial" not in error["message"]


# ---- greedy clients ----

@pytest.mark.parametrize("fields, limit, param", [
    (dict(n=4, max_tokens=4, temperature=1.0), "--max-request-output-tokens", "n"),  # 16 > 12
    (dict(max_tokens=13), "--max-request-output-tokens", "max_tokens"),
    (dict(prompt=list(range(1, 22)), n=2, max_tokens=1, temperature=1.0), "--max-request-prompt-tokens", "n"),
])
def test_a_request_over_a_cost_cap_is_a_400_naming_the_limit(open_server, fields, limit, param):
    response = httpx2.post(f"{open_server.url}/v1/completions", json=body(**{"prompt": PROMPT, **fields}),
                           timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "request_too_costly" and error["param"] == param
    assert limit in error["message"]


def test_requests_within_the_caps_are_served(open_server):
    response = httpx2.post(f"{open_server.url}/v1/completions", json=body(prompt=PROMPT, n=3, max_tokens=4,
                                                                         temperature=1.0), timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3


def test_by_default_one_request_costs_at_most_one_context(engine):
    server = ThreadedServer(build_app(engine, MODEL_NAME)).start()
    max_tokens = engine.max_model_len // 64 + 1  # n = 128 at this length asks for more than the context
    try:
        response = httpx2.post(f"{server.url}/v1/completions",
                               json=body(prompt=PROMPT, n=128, max_tokens=max_tokens, temperature=1.0), timeout=60)
    finally:
        server.stop()
    assert response.status_code == 400 and str(engine.max_model_len) in response.json()["error"]["message"]


# ---- slow clients ----

@pytest.fixture(scope="module")
def strict_server(engine):
    server = GuardedServer(build_app(engine, MODEL_NAME, limits=ClientLimits(body_timeout_s=0.5)),
                           header_timeout_s=0.5, keep_alive_s=30).start()
    yield server
    server.stop()


def test_a_request_head_that_never_completes_is_closed(strict_server):
    with socket.create_connection(address(strict_server), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        assert read_all(connection) == b""  # closed by the server, not by the 30 s socket timeout


def test_a_keep_alive_connection_dribbling_its_next_head_is_closed(strict_server):
    with socket.create_connection(address(strict_server), timeout=30) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        connection.sendall(b"G")  # cancels uvicorn's idle timer; the head deadline still runs
        assert read_all(connection) == b""


def test_a_body_that_stalls_is_a_408(strict_server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 400\r\n\r\n")
    with socket.create_connection(address(strict_server), timeout=30) as connection:
        connection.sendall(head + b'{"model": "')
        status, _, payload = read_all(connection).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408")
    assert json.loads(payload)["error"]["code"] == "request_timeout"


def test_a_prompt_client_is_unaffected_by_the_deadlines(strict_server):
    with httpx2.Client(base_url=strict_server.url, timeout=60) as http:
        for _ in range(2):  # twice on one keep-alive connection
            response = http.post("/v1/completions", json=body(prompt=PROMPT))
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
