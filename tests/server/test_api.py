"""The HTTP API on a real uvicorn over a real AsyncLLMEngine: outputs equal the offline API, streams, usage,
metrics, a bad-input suite, engine failures and client disconnects."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from nebula_engine import SamplingParams
from nebula_engine.config import EngineConfig
from nebula_engine.engine.async_engine import AsyncLLMEngine
from nebula_engine.server.api import build_app
from tests.server.conftest import ENGINE_SETTINGS, MODEL_NAME, ObservedEngine, ThreadedServer

PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def served(qwen3_dir):
    """(server, async engine) — one engine behind one real uvicorn for the whole module."""
    engine = AsyncLLMEngine(ObservedEngine(EngineConfig.create(str(qwen3_dir), **ENGINE_SETTINGS)))
    server = ThreadedServer(build_app(engine, MODEL_NAME)).start()
    yield server, engine
    server.stop()
    engine.shutdown()


@pytest.fixture()
def http(served):
    with httpx2.Client(base_url=served[0].url, timeout=60) as client:
        yield client


def greedy(max_tokens=8, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}


def sse_payloads(lines) -> list:
    """Every ``data:`` payload of a stream's lines, ``[DONE]`` as the string itself."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def stream(http, path: str, **fields) -> list:
    with http.stream("POST", path, json=body(stream=True, **fields)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response.iter_lines())


def metric(http, name: str, **labels) -> float:
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def test_models_health_and_metrics_endpoints(http, served):
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == served[1].max_model_len
    text = http.get("/metrics").text
    for series in ("nebula_requests_waiting", "nebula_requests_running", "nebula_time_to_first_token_seconds_bucket"):
        assert series in text


def test_completion_equals_offline_generate(http, reference_llm):
    response = http.post("/v1/completions", json=body(prompt=PROMPT))
    assert response.status_code == 200
    result = response.json()
    [expected] = reference_llm.generate(PROMPT, greedy())
    assert result["object"] == "text_completion"
    assert result["choices"][0]["text"] == expected.outputs[0].text
    assert result["choices"][0]["finish_reason"] == "length"
    usage = result["usage"]
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert set(usage["nebula"]) == {"prefix_cached_tokens"}  # no PIC segments: no PIC split


def test_token_id_prompts_and_a_list_of_one_string(http, reference_llm):
    token_ids = reference_llm.get_tokenizer().encode(PROMPT)
    by_ids = http.post("/v1/completions", json=body(prompt=token_ids)).json()
    by_list = http.post("/v1/completions", json=body(prompt=[PROMPT])).json()
    [expected] = reference_llm.generate(PROMPT, greedy())
    assert by_ids["choices"][0]["text"] == by_list["choices"][0]["text"] == expected.outputs[0].text


def test_streamed_completion_with_usage(http, reference_llm):
    payloads = stream(http, "/v1/completions", prompt=PROMPT, stream_options={"include_usage": True})
    [expected] = reference_llm.generate(PROMPT, greedy())
    assert payloads[-1] == "[DONE]"
    *chunks, usage_chunk = payloads[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.outputs[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert len({c["id"] for c in payloads[:-1]}) == 1


def test_chat_equals_offline_chat_streamed_or_not(http, reference_llm):
    [expected] = reference_llm.chat(CHAT, greedy())
    result = http.post("/v1/chat/completions", json=body(messages=CHAT)).json()
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": expected.outputs[0].text,
                                               "tool_calls": []}  # vLLM's shape: an empty list, not absent
    assert result["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    payloads = stream(http, "/v1/chat/completions", messages=CHAT)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected.outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_accepts_max_completion_tokens(http):
    messages = [{"role": "user", "content": "hi"}]
    result = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "temperature": 0,
                                                     "max_completion_tokens": 3}).json()
    assert result["usage"]["completion_tokens"] <= 3


def test_concurrent_clients_each_get_their_own_answer(served, reference_llm):
    prompts = ["a b c d", "Once upon a time", "1, 2, 3,", "Paged attention is"]

    def ask(index_and_prompt):
        index, prompt = index_and_prompt
        with httpx2.Client(base_url=served[0].url, timeout=60) as client:
            if index % 2:
                chunks = stream(client, "/v1/completions", prompt=prompt)[:-1]
                return "".join(c["choices"][0]["text"] for c in chunks)
            return client.post("/v1/completions", json=body(prompt=prompt)).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, enumerate(prompts)))
    assert texts == [o.outputs[0].text for o in reference_llm.generate(prompts, greedy())]


def test_stop_string_never_streams_past_the_stop(http, reference_llm):
    full = reference_llm.generate(PROMPT, greedy(max_tokens=16))[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    result = http.post("/v1/completions", json=body(prompt=PROMPT, max_tokens=16, stop=stop)).json()
    assert result["choices"][0] == {"index": 0, "text": expected, "logprobs": None, "finish_reason": "stop",
                                    "stop_reason": stop, "prompt_logprobs": None}  # vLLM's extra fields
    chunks = stream(http, "/v1/completions", prompt=PROMPT, max_tokens=16, stop=[stop])[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_repeated_prompt_reports_prefix_cached_tokens(http):
    prompt = " ".join(f"word{i}" for i in range(40))  # several full 8-token pages
    before = metric(http, "nebula_cached_prompt_tokens_total", kind="prefix")
    first = http.post("/v1/completions", json=body(prompt=prompt, max_tokens=2)).json()["usage"]
    second = http.post("/v1/completions", json=body(prompt=prompt, max_tokens=2)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"]
    assert second["nebula"] == {"prefix_cached_tokens": cached}
    assert metric(http, "nebula_cached_prompt_tokens_total", kind="prefix") - before == cached


def test_pic_tags_and_explicit_segments_give_the_same_prompt(http, served):
    tokenizer = served[1].tokenizer
    tagged = "Context: <pic>Paris is the capital of France.</pic> <pic>Rome is in Italy.</pic> Question: where?"
    segmented = tokenizer.segment_prompt(tagged)
    segments = [{"kind": s.kind.value, "token_ids": list(segmented.segment_ids(s))} for s in segmented.segments]
    assert [s["kind"] for s in segments].count("pic") == 2
    # "full" recomputes every reused token: exactly what PIC off computes
    by_tags = http.post("/v1/completions", json=body(prompt=tagged, pic_backend="full")).json()
    by_segments = http.post("/v1/completions", json=body(segments=segments, prompt=list(segmented.token_ids),
                                                         pic_backend="full")).json()
    pic_off = http.post("/v1/completions", json=body(prompt=tagged, pic_backend=None)).json()
    assert by_tags["usage"]["prompt_tokens"] == len(segmented.token_ids)
    assert by_tags["choices"][0]["text"] == by_segments["choices"][0]["text"] == pic_off["choices"][0]["text"]


def test_documents_reused_at_new_positions_are_reported_as_pic_cached(http):
    docs = ["<pic>The Nile flows north through Egypt.</pic>", "<pic>The Danube ends in the Black Sea.</pic>"]
    http.post("/v1/completions", json=body(prompt=f"Read: {docs[0]} {docs[1]} Which river?", pic_backend="full"))
    before = metric(http, "nebula_cached_prompt_tokens_total", kind="pic")
    reordered = f"Docs, other order: {docs[1]} {docs[0]} Which sea?"
    usage = http.post("/v1/completions", json=body(prompt=reordered, pic_backend="full")).json()["usage"]
    split = usage["nebula"]
    assert split["pic_cached_tokens"] > 0 and split["recomputed_tokens"] == split["pic_cached_tokens"]
    # "full" recomputed every reused token: only the prefix cache's hits were used as they were
    assert usage["prompt_tokens_details"]["cached_tokens"] == split["prefix_cached_tokens"]
    assert metric(http, "nebula_cached_prompt_tokens_total", kind="pic") - before == split["pic_cached_tokens"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BAD_REQUESTS = [  # (path, raw body, param the error names)
    ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": ', None),  # malformed JSON
    ("/v1/completions", b'["not", "an", "object"]', None),
    ("/v1/completions", {"prompt": PROMPT}, "model"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": 12}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", 5]}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 5}, "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "n": 129}, "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "echo": "yes"}, "echo"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0}, "max_tokens"),  # needs echo
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "bad_words": "darn"}, "bad_words"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "allowed_token_ids": [10 ** 8]},
     "allowed_token_ids"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "truncate_prompt_tokens": -2},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "include_stop_str_in_output": "yes"},
     "include_stop_str_in_output"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "skip_special_tokens": 0}, "skip_special_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "spaces_between_special_tokens": "no"},
     "spaces_between_special_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "return_tokens_as_token_ids": 1},
     "return_tokens_as_token_ids"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "request_id": 7}, "request_id"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "stream": True,
                         "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "response_format": {"type": "yaml"}},
     "response_format"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "<pic>never closed"}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a </pic> b"}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 4096}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4000}, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [10 ** 9]}, None),  # the engine's check: no field named
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "pic_backend": "bogus"}, None),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "pic_backend": 3}, "pic_backend"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "segments": [{"kind": "pik", "token_ids": [5]}]}, "segments"),
    ("/v1/completions", {"model": MODEL_NAME, "segments": [{"kind": "pic", "token_ids": []}]}, "segments"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "<pic>a<pic>b</pic>"}]},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": None}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "tools": [TOOL]}, "tool_choice"),  # no parser
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "chat_template_kwargs": ["enable_thinking"]},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "add_generation_prompt": "no"},
     "add_generation_prompt"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT + [{"role": "assistant", "content": "Re"}],
                              "continue_final_message": True}, "continue_final_message"),  # and the generation prompt
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "continue_final_message": True,
                              "add_generation_prompt": False}, "continue_final_message"),  # last is the user's
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "echo": 1}, "echo"),
]


def test_bad_requests_get_400_with_a_message_and_the_server_keeps_serving(http):
    invalid_before = metric(http, "nebula_requests_total", endpoint="completions", status="invalid")
    for path, raw, param in BAD_REQUESTS:
        content = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, (raw, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], raw
        assert error["param"] == param, (raw, error)
    num_completions = sum(path == "/v1/completions" for path, _, _ in BAD_REQUESTS)
    assert metric(http, "nebula_requests_total", endpoint="completions", status="invalid") - invalid_before == \
        num_completions
    good = http.post("/v1/completions", json=body(prompt=PROMPT))
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8


def test_unknown_route_is_an_openai_style_404(http):
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_engine_failure_mid_stream_sends_an_error_event_then_the_server_recovers(http, served):
    observed = served[1].engine
    with http.stream("POST", "/v1/completions", json=body(prompt=PROMPT, max_tokens=1500, stream=True)) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream is live
        observed.fail_next_step()
        payloads = sse_payloads(lines)
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert payloads[-1] == "[DONE]" and len(errors) == 1
    message = errors[0]["error"]["message"]
    assert "internal error (id " in message and "injected device failure" not in message  # detail in the log only
    assert http.post("/v1/completions", json=body(prompt=PROMPT)).status_code == 200


def test_client_disconnect_mid_stream_aborts_the_request(served):
    server, engine = served
    observed = engine.engine
    observed.abort_seen.clear()
    with httpx2.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body(prompt=PROMPT, max_tokens=1500, stream=True)) as r:
            first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert observed.abort_seen.wait(timeout=30)
    assert (first["id"], True) in observed.aborted  # the engine still ran it: the disconnect stopped it


def test_client_disconnect_while_waiting_for_a_full_response_aborts_the_request(served):
    server, engine = served
    observed = engine.engine
    observed.abort_seen.clear()
    payload = json.dumps(body(prompt=PROMPT, max_tokens=1500)).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 30  # the engine thread admits it asynchronously
        while engine.stats().num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    assert observed.abort_seen.wait(timeout=30)
    [(request_id, stopped)] = observed.aborted[-1:]
    assert request_id.startswith("cmpl-") and stopped
