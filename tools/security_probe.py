"""Probe a real server and engine as an attacker and a careless client would, and count what got through.

One engine on a tiny checkpoint (or ``--model``), served by uvicorn on 127.0.0.1 with an API key and short client
deadlines, is sent: malformed requests of many kinds (every one must be a 4xx, none a 5xx); every route without the
key (all 401 but ``/health`` and ``/metrics``); a greedy request (``n = 128``: a 400 naming the limit); clients that
never finish a request head or body (each must be closed). Control frames are forged, replayed, misaddressed and
replaced by a pickle (none may be accepted). A disk tier warmed with a document is tampered with (a planted
pickle, the KV zeroed with its checksum recomputed, one entry's file filed under another key, ``index.json``
replaced by a symlink out of the store): every request must still be answered, with the answer of an engine that
never had a disk tier, and nothing outside the store may be read.

    python tools/security_probe.py [--model DIR] [--short] [--write-docs]

``--write-docs`` writes ``docs/results/security.md`` (machine, command, table). The test suite runs ``--short``
(a sample of the malformed kinds, 5 slow clients of each kind, the first two tamperings).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import platform
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nebula_engine import LLM, SamplingParams  # noqa: E402
from nebula_engine.cluster.runtime.auth import FrameRejected, FrameSealer, new_secret  # noqa: E402
from nebula_engine.config import EngineConfig  # noqa: E402
from nebula_engine.engine.async_engine import AsyncLLMEngine  # noqa: E402
from nebula_engine.engine.offline_prefill import OfflinePrefill, build_prefill_engine  # noqa: E402
from nebula_engine.kvcache.disk_tier import INDEX_FILE, serialize  # noqa: E402
from nebula_engine.model.tiny import make_tiny_checkpoint  # noqa: E402
from nebula_engine.server.api import build_app  # noqa: E402
from nebula_engine.server.guards import header_timeout_protocol  # noqa: E402
from nebula_engine.server.limits import ClientLimits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PAGE = ROOT / "docs" / "results" / "security.md"
API_KEY = "sk-probe-0123456789abcdef"
MODEL_NAME = "probe"
CLIENT_DEADLINE_S = 1.0  # the probe's header and body deadlines: short, so slow clients are seen closed quickly
ENGINE = dict(page_size=4, num_pages=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DOCUMENTS = ("Owls hunt at night and can turn their heads almost all the way around.",
             "The Rhine flows from the Swiss Alps to the North Sea through six countries.")
PROMPT = "Use these notes.\n" + "".join(f"<pic>{d}</pic>" for d in DOCUMENTS) + "\nQuestion: owls?"


@dataclass(frozen=True)
class Row:
    area: str
    case: str
    sent: int
    bad: int  # how many got through: a 5xx, an accepted forgery, a wrong answer, a client left open, ...
    bad_means: str

    @property
    def passed(self) -> bool:
        return self.bad == 0


class Server(uvicorn.Server):
    def __init__(self, app):
        super().__init__(uvicorn.Config(app, log_level="error", lifespan="off", timeout_keep_alive=5,
                                        http=header_timeout_protocol(CLIENT_DEADLINE_S)))
        self.ready = threading.Event()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.run, kwargs={"sockets": [self._socket]}, daemon=True)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready.set()

    def __enter__(self) -> Server:
        self._thread.start()
        if not self.ready.wait(60):
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.should_exit = self.force_exit = True
        self._thread.join(30)
        self._socket.close()


# ---- HTTP ----

def malformed_requests(short: bool) -> list[tuple[str, bytes]]:
    """(path, raw JSON body) of requests every one of which is the client's fault."""
    base = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    fields = {"prompt": [None, 1.5, {}, [[]], [-1], [2 ** 64], "\ud800"], "max_tokens": [0, -1, 2 ** 70, "x", []],
              "n": [0, 129, "2", 1.5], "temperature": [-1, 3, "hot"], "top_p": [0, 2], "top_k": [-2, 2 ** 63],
              "seed": [2 ** 64, "s"], "stop": [[None], {"role": "user"}, [""], ["a"] * 100, [["a"]]],
              "logprobs": [-1, 99], "logit_bias": [{"x": 1}, {"1": 1000}], "segments": [[{"kind": "pic"}], "x"],
              "stop_token_ids": [[-1], [2 ** 63]], "model": [1, "other-model"], "stream": ["yes"]}
    requests = [("/v1/completions", json.dumps({**base, k: v}).encode()) for k, vs in fields.items() for v in vs]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    chat_fields = {"messages": [[], None, [{"role": "nobody", "content": "x"}], [{"role": "user", "content": 1}],
                                [{"role": "user", "content": "<pic>unclosed"}]],
                   "tools": [[{"type": "function"}], "x"], "tool_choice": [{"type": "function"}, "sometimes"],
                   "response_format": [{"type": "json_schema"}, {"type": "xml"}],
                   "max_completion_tokens": [2 ** 64]}
    requests += [("/v1/chat/completions", json.dumps({**chat, k: v}).encode())
                 for k, vs in chat_fields.items() for v in vs]
    requests += [("/v1/completions", raw) for raw in (b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe",
                                                       b'{"prompt": "a", "temperature": NaN}',
                                                       b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")]
    return requests[::4] if short else requests


def probe_http(engine: AsyncLLMEngine, short: bool) -> list[Row]:
    app = build_app(engine, MODEL_NAME, api_key=API_KEY, limits=ClientLimits(body_timeout_s=CLIENT_DEADLINE_S))
    keyed = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    rows = []
    with Server(app) as server, httpx2.Client(base_url=server.url, timeout=60) as http:
        requests = malformed_requests(short)
        statuses = [http.post(path, content=raw, headers=keyed).status_code for path, raw in requests]
        rows.append(Row("input", f"malformed requests ({len(requests)} kinds)", len(requests),
                        sum(not 400 <= s < 500 for s in statuses), "not a 4xx (any 5xx counts)"))
        routes = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                  ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"), ("GET", "/cluster"),
                  ("GET", "/docs"), ("GET", "/anything")]
        unguarded = [path for method, path in routes if http.request(method, path).status_code != 401]
        rows.append(Row("auth", "routes without the key", len(routes), len(unguarded), "answered without a 401"))
        probes = [http.get(path).status_code for path in ("/health", "/metrics")]
        rows.append(Row("auth", "/health and /metrics without the key", 2, sum(s != 200 for s in probes),
                        "not open to probes"))
        greedy = http.post("/v1/completions", headers=keyed, json={
            "model": MODEL_NAME, "prompt": "hi", "n": 128, "max_tokens": engine.max_model_len // 64 + 1,
            "temperature": 1.0})
        bounded = greedy.status_code == 400 and "--max-request-output-tokens" in greedy.json()["error"]["message"]
        rows.append(Row("greedy", "n = 128 over one context's tokens", 1, int(not bounded),
                        "not a 400 naming the limit"))
        rows += probe_slow_clients(server, 5 if short else 200)
    return rows


def probe_slow_clients(server: Server, count: int) -> list[Row]:
    """``count`` clients stopping mid-head and ``count`` mid-body; after the deadlines, how many are still open."""
    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"] * count
    bodies = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\": "] * count
    rows = []
    for case, payloads in (("clients that never finish a request head", heads),
                           ("clients that never finish a body", bodies)):
        connections = []
        for payload in payloads:
            connection = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            connection.sendall(payload)
            connections.append(connection)
        time.sleep(CLIENT_DEADLINE_S + 2.0)  # the deadline, plus scheduling slack on a loaded machine
        still_open = sum(_is_open(c) for c in connections)
        for connection in connections:
            connection.close()
        rows.append(Row("slow", f"{case} ({CLIENT_DEADLINE_S:g} s deadlines)", count, still_open,
                        "still open after the deadline"))
    return rows


def _is_open(connection: socket.socket) -> bool:
    """Whether the server still holds the connection (a 408 it sent counts as closing it)."""
    connection.setblocking(False)
    try:
        data = connection.recv(65536)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return data != b"" and not data.startswith(b"HTTP/1.1 408")


# ---- control frames ----

def probe_frames() -> list[Row]:
    secret = new_secret()
    sender, receiver, outsider = FrameSealer("a", secret), FrameSealer("b", secret), FrameSealer("a", new_secret())
    honest = sender.seal("b", b'{"kind": "heartbeat"}')
    frames = {
        "sealed with another secret": outsider.seal("b", b'{"kind": "heartbeat"}'),
        "addressed to another peer": sender.seal("c", b'{"kind": "heartbeat"}'),
        "body changed after sealing": honest[:-2] + b"!}",
        "truncated header": honest[:10],
        "a bare pickle": pickle.dumps({"kind": "heartbeat"}),
        "empty": b"",
    }
    accepted = 0
    for frame in frames.values():
        try:
            receiver.open(frame)
            accepted += 1
        except FrameRejected:
            pass
    stamp, _ = receiver.open(honest)
    receiver.accept("a", stamp)
    try:
        receiver.accept("a", receiver.open(honest)[0])  # the same frame again
        accepted += 1
    except FrameRejected:
        pass
    return [Row("frames", "forged, misaddressed, altered, pickled and replayed control frames", len(frames) + 1,
                accepted, "accepted")]


# ---- disk tier ----

def probe_disk_tier(model: str, workdir: Path, short: bool) -> list[Row]:
    """Each tampering of a warmed store, then three requests needing it (``short``: the first two tamperings)."""
    reference = LLM(model, pic_backend="epic", **ENGINE).generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    rows = []
    tamperings = (("a pickle planted with its size and SHA-256", _plant_pickle),
                  ("KV zeroed, SHA-256 recomputed", _zero_kv),
                  ("one entry's file and MAC filed under another key", _swap_entries),
                  ("index.json a symlink to an index outside the store", _link_index))
    for case, tamper in tamperings[:2] if short else tamperings:
        root = workdir / f"disk-{tamper.__name__.strip('_')}"
        _warm(model, root, workdir)
        outside_reads = tamper(root, workdir)
        answers, failures, leaked = [], 0, 0
        try:
            served = LLM(model, pic_backend="epic", disk_cache_tokens=100_000, disk_cache_path=str(root), **ENGINE)
            for _ in range(3):
                try:
                    answers.append(served.generate(PROMPT, GREEDY)[0].outputs[0].token_ids)
                except Exception:  # what a 500 would be: counted, the probe goes on
                    failures += 1
            served.llm_engine.cache_store.close()
            leaked = outside_reads(served.llm_engine.cache_store.tiers.disk)
        except Exception:
            failures += 3
        wrong = sum(answer != reference for answer in answers)
        pwned = (workdir / "pwned").exists()
        rows.append(Row("disk tier", case, 3, failures + wrong + leaked + int(pwned),
                        "failed request, wrong answer, read outside the store or code run"))
    return rows


def _warm(model: str, root: Path, workdir: Path) -> None:
    corpus = workdir / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    runner = OfflinePrefill(build_prefill_engine(model, root, "epic", **ENGINE))
    try:
        runner.run(str(corpus))
    finally:
        runner.close()


def _index(root: Path) -> dict:
    return json.loads((root / INDEX_FILE).read_text())


def _rewrite(root: Path, file: str, data: bytes) -> None:
    """What anyone able to write the store can do without its key: new bytes, their size and plain SHA-256."""
    (root / file).write_bytes(data)
    index = _index(root)
    for entry in index["entries"]:
        if entry["file"] == file:
            entry["nbytes"], entry["mac"] = len(data), hashlib.sha256(data).hexdigest()
    (root / INDEX_FILE).write_text(json.dumps(index))


def _pic_files(root: Path) -> list[str]:
    return [e["file"] for e in _index(root)["entries"] if e["kind"] == "pic"]


class _Pwn:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_pickle(root: Path, workdir: Path):
    _rewrite(root, _pic_files(root)[0], pickle.dumps(_Pwn(workdir / "pwned")))
    return lambda disk: 0


def _zero_kv(root: Path, workdir: Path):
    file = _pic_files(root)[0]
    payload = torch.load(io.BytesIO((root / file).read_bytes()), weights_only=True)
    payload["pages"] = [torch.zeros_like(t) for t in payload["pages"]]
    _rewrite(root, file, serialize(payload))
    return lambda disk: 0


def _swap_entries(root: Path, workdir: Path):
    first, second = _pic_files(root)[:2]
    index = _index(root)
    by_file = {e["file"]: e for e in index["entries"]}
    (root / second).write_bytes((root / first).read_bytes())
    by_file[second]["nbytes"], by_file[second]["mac"] = by_file[first]["nbytes"], by_file[first]["mac"]
    (root / INDEX_FILE).write_text(json.dumps(index))
    return lambda disk: 0


def _link_index(root: Path, workdir: Path):
    """The store's index replaced by a link to a file outside it; counted: entries loaded from it, writes to it."""
    outside = workdir / "outside-index.json"
    outside.write_text(json.dumps({"version": 2, "entries": [
        {"kind": "pic", "key": "f" * 64, "num_tokens": 4, "file": f"pic-{'f' * 64}.kv", "nbytes": 1, "mac": "0"}]}))
    (root / INDEX_FILE).unlink()
    (root / INDEX_FILE).symlink_to(outside)
    before = outside.read_bytes()

    def outside_reads(disk) -> int:
        return sum(e.key == "f" * 64 for e in disk.entries()) + int(outside.read_bytes() != before)
    return outside_reads


# ---- report ----

def format_table(rows: list[Row]) -> str:
    lines = ["| area | case | sent | got through | counted as got through | result |", "|---|---|---:|---:|---|---|"]
    lines += [f"| {r.area} | {r.case} | {r.sent} | {r.bad} | {r.bad_means} | {'pass' if r.passed else 'FAIL'} |"
              for r in rows]
    return "\n".join(lines)


def write_results_page(rows: list[Row], command: str) -> Path:
    RESULTS_PAGE.parent.mkdir(parents=True, exist_ok=True)
    machine = (f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    failed = [r for r in rows if not r.passed]
    RESULTS_PAGE.write_text(
        "# Security probe\n\n"
        "What `tools/security_probe.py` sent to one engine behind the HTTP API (API key, 1 s client deadlines, "
        "default cost caps), to the control-frame sealer, and to a tampered disk tier, and how much of it got "
        "through. Every row must show 0.\n\n"
        f"- machine: {machine}\n- command: `{command}`\n"
        f"- result: {len(rows) - len(failed)} of {len(rows)} checks pass\n\n{format_table(rows)}\n")
    return RESULTS_PAGE


def run(model: str | None, short: bool, workdir: Path) -> list[Row]:
    if model is None:
        model = str(make_tiny_checkpoint("qwen3", workdir / "model"))
    engine = AsyncLLMEngine.from_config(EngineConfig.create(model, **ENGINE))
    try:
        rows = probe_http(engine, short)
    finally:
        engine.shutdown()
    return rows + probe_frames() + probe_disk_tier(model, workdir, short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random Qwen3 written for the probe)")
    parser.add_argument("--short", action="store_true", help="fewer malformed kinds and slow clients (the suite's)")
    parser.add_argument("--write-docs", action="store_true", help=f"write {RESULTS_PAGE.relative_to(ROOT)}")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nebula-security-probe-") as workdir:
        rows = run(options.model, options.short, Path(workdir))
    print(format_table(rows))
    if options.write_docs:
        command = "python tools/security_probe.py " + " ".join(sys.argv[1:])
        print(f"wrote {write_results_page(rows, command.strip())}")
    sys.exit(0 if all(r.passed for r in rows) else 1)


if __name__ == "__main__":
    main()
