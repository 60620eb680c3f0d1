"""Fixtures: a tiny Qwen3, an engine we can observe (aborts) and break (one failing step), a real uvicorn."""

from __future__ import annotations

import socket
import threading

import pytest
import uvicorn

from nebula_engine.config import EngineConfig
from nebula_engine.engine.llm_engine import LLMEngine
from tests.model_cases import CASES_BY_NAME, checkpoint_factory  # noqa: F401  (fixture)

ENGINE_SETTINGS = dict(num_pages=256, page_size=8, max_num_batched_tokens=64)
MODEL_NAME = "tiny-qwen3"


class ObservedEngine(LLMEngine):
    """The real engine plus two test hooks: each ``abort_request`` is recorded (with whether it stopped a live
    request) and signalled, and ``fail_next_step()`` makes the next ``step`` raise once."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.aborted: list[tuple[str, bool]] = []
        self.abort_seen = threading.Event()
        self._fail_next_step = threading.Event()

    def abort_request(self, request_id: str) -> bool:
        stopped = super().abort_request(request_id)
        self.aborted.append((request_id, stopped))
        self.abort_seen.set()
        return stopped

    def fail_next_step(self) -> None:
        self._fail_next_step.set()

    def step(self):
        if self._fail_next_step.is_set():
            self._fail_next_step.clear()
            super().step()  # the batch really runs, then "the device" fails
            raise RuntimeError("injected device failure")
        return super().step()


class ThreadedServer(uvicorn.Server):
    """uvicorn in a background thread on a free 127.0.0.1 port; ``ready`` is set once it accepts connections."""

    def __init__(self, app):
        super().__init__(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.ready = threading.Event()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self.run, kwargs={"sockets": [self._socket]}, daemon=True)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.ready.set()

    def start(self) -> ThreadedServer:
        self._thread.start()
        if not self.ready.wait(timeout=60):
            raise RuntimeError("uvicorn did not start")
        return self

    def stop(self) -> None:
        self.should_exit = self.force_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


def serve_for_openai_clients(llm_engine: LLMEngine):
    """Serve ``llm_engine`` over HTTP for the openai-client tests (yields the running server, then stops both).

    Constrained JSON is compact: random weights would otherwise spend max_tokens on the whitespace JSON allows."""
    from nebula_engine.engine.async_engine import AsyncLLMEngine
    from nebula_engine.server.api import build_app

    engine = AsyncLLMEngine(llm_engine)
    served = ThreadedServer(build_app(engine, MODEL_NAME, disable_any_whitespace=True)).start()
    yield served
    served.stop()
    engine.shutdown()


def openai_client(server: ThreadedServer):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def client(server):
    """The real ``openai`` client on the module's ``server`` fixture."""
    return openai_client(server)


def offline(reference_llm, prompt, **params):
    """The offline engine's one output for ``prompt``: what the server's answer is compared with."""
    from nebula_engine import SamplingParams

    [output] = reference_llm.generate(prompt, SamplingParams(**params))
    return output


@pytest.fixture(scope="session")
def qwen3_dir(checkpoint_factory):
    return checkpoint_factory(CASES_BY_NAME["qwen3_gqa2_hd20"])


@pytest.fixture(scope="session")
def reference_llm(qwen3_dir):
    """The offline API on the same checkpoint and settings: what the server must reproduce."""
    from nebula_engine import LLM

    return LLM(str(qwen3_dir), **ENGINE_SETTINGS)


@pytest.fixture(scope="session")
def observed_engine(qwen3_dir):
    return ObservedEngine(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS))


@pytest.fixture(scope="session")
def qwen3_tools_dir(qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 with Qwen's tool-calling chat template (weights and vocabulary linked, not copied)."""
    from tests.server.tool_template import QWEN_TOOL_TEMPLATE

    out = tmp_path_factory.mktemp("qwen3_tools")
    for item in qwen3_dir.iterdir():
        if item.name != "chat_template.jinja":
            (out / item.name).symlink_to(item)
    (out / "chat_template.jinja").write_text(QWEN_TOOL_TEMPLATE)
    return out
