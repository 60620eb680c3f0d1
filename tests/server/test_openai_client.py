"""``serve`` in its own process, driven by the official ``openai`` client: a streamed chat with ``<pic>`` tags,
the API key from ``NEBULA_API_KEY`` and the ``--max-request-bytes`` limit."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
import pytest

from nebula_engine import SamplingParams
from tests.server.conftest import MODEL_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = secrets.token_urlsafe(24)
MAX_REQUEST_BYTES = 64 * 1024
MESSAGES = [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": "<pic>Paris is the capital of France.</pic>\n"
                                        "<pic>Rome is the capital of Italy.</pic>\nWhere is Rome?"}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(qwen3_dir, tmp_path_factory):
    """``nebula-engine serve`` (the click command) as a subprocess, stopped by pid at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-c", "from nebula_engine.cli.serve import serve; serve()",
               "--model", str(qwen3_dir), "--served-model-name", MODEL_NAME, "--port", str(port),
               "--page-size", "8", "--num-pages", "256", "--max-num-batched-tokens", "64", "--log-level", "warning",
               "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, "NEBULA_API_KEY": API_KEY})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _wait_until_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # another process: poll, with a deadline
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"serve did not become healthy in {timeout} s:\n{log.read_text()[-3000:]}")


def test_openai_client_streams_a_chat_with_pic_tags(server_url, reference_llm):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "pic_backend": "full"}))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    # PIC backend "full" recomputes every reused token, so plain generation on the same ids is the reference
    prompt = reference_llm.llm_engine.tokenizer.segment_chat(MESSAGES)
    assert len(prompt.pic_segments) == 2
    [expected] = reference_llm.generate({"prompt_token_ids": list(prompt.token_ids)},
                                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert text == expected.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt.token_ids)
    assert chunks[-1].usage.completion_tokens == 8
    assert set(chunks[-1].usage.model_extra["nebula"]) == {"prefix_cached_tokens", "pic_cached_tokens",
                                                           "recomputed_tokens"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_sees_bad_pic_tags_as_a_bad_request(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unclosed <pic>"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "<pic>oops"}])
    reply = client.completions.create(model=MODEL_NAME, prompt="Still there?", max_tokens=2)
    assert reply.usage.completion_tokens <= 2 and reply.choices[0].finish_reason in ("stop", "length")


def test_the_api_key_comes_from_the_environment_and_guards_only_v1(server_url):
    wrong = openai.OpenAI(base_url=f"{server_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    response = httpx2.post(f"{server_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    for route, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):  # model work too
        assert httpx2.post(f"{server_url}{route}", json=payload, timeout=30).status_code == 401
        assert httpx2.post(f"{server_url}{route}", json=payload, timeout=30,
                           headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx2.get(f"{server_url}/health", timeout=30).status_code == 200
    assert httpx2.get(f"{server_url}/metrics", timeout=30).status_code == 200


def test_a_body_over_max_request_bytes_is_a_413(server_url):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError, match="limit of 65536 bytes") as raised:
        client.completions.create(model=MODEL_NAME, prompt="word " * MAX_REQUEST_BYTES, max_tokens=1)
    assert raised.value.status_code == 413
