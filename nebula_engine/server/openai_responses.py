"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``), which the Agents SDK and newer
OpenAI clients default to, over the chat path.

A request becomes a chat request: ``instructions`` a system message, then the stored conversation of
``previous_response_id``, then ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``); function ``tools`` and ``tool_choice`` keep their chat meaning. So templates, ``<pic>``
tags, tool parsing and structured outputs work as in chat. ``store`` (default true) keeps each response's
conversation in memory for ``previous_response_id``, the newest ``max_stored`` only: an evicted or unknown id is a
404 saying so. A stream sends the Responses event sequence: ``response.created``, ``response.in_progress``, per
output item ``response.output_item.added`` ... ``response.output_text.delta`` (or
``response.function_call_arguments.delta``) ... ``response.output_item.done``, then ``response.completed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.server.engine_client import EngineClient, EngineError
from nebula_engine.server.errors import INTERNAL_ERROR, APIError, from_validation_errors
from nebula_engine.server.inputs import OutputSettings, chat_input, warn_ignored_fields
from nebula_engine.server.metrics import ServerMetrics
from nebula_engine.server.protocol import ChatCompletionRequest, JSONObject, Text, TokenCount, _Strict
from nebula_engine.server.responses import TextDeltas, cached_tokens
from nebula_engine.server.tool_streaming import CallDelta, ToolCallDeltas

ENDPOINT = "responses"  # its label in the request metrics
DEFAULT_MAX_STORED = 1024  # responses kept for previous_response_id: each a conversation's text, KBs each


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Text = Field(min_length=1, max_length=64)
    description: Optional[Text] = None
    parameters: Optional[JSONObject] = None
    strict: Optional[bool] = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Text


UNSERVED_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(_Strict):
    model: Text
    input: Union[Text, list[JSONObject]]
    instructions: Optional[Text] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[TokenCount] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[Text] = None
    metadata: Optional[dict[str, Text]] = None
    user: Optional[Text] = None
    # extra output parts (OpenAI's includables; the Agents SDK always sends the list): those of reasoning, search,
    # image and code tools have nothing to add here; output-text logprobs are refused (``_chat_request``)
    include: Optional[list[Text]] = None
    pic_backend: Optional[Text] = None  # as in chat: absent, the engine's default; null, PIC off


class ResponseStore:
    """The newest ``capacity`` stored conversations, by response id (least recently stored leaves first)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED):
        if capacity < 1:
            raise ValueError(f"the response store needs room for at least one response, got {capacity}")
        self.capacity = capacity
        self._conversations: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self._conversations[response_id] = (messages, body)
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)

    def messages(self, response_id: str) -> list[dict[str, Any]]:
        return self._get(response_id, "previous_response_id")[0]

    def body(self, response_id: str) -> dict[str, Any]:
        return self._get(response_id, "response_id")[1]

    def _get(self, response_id: str, param: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if response_id not in self._conversations:
            raise APIError(f"response {response_id!r} is not stored here: it was made with store false, by another "
                           f"server, or evicted (this server keeps the newest {self.capacity})", status=404,
                           param=param, code="response_not_found")
        return self._conversations[response_id]


def chat_messages(request: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a Responses request continues, as chat messages."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += [m for m in history if m["role"] != "system" or not request.instructions]
    if isinstance(request.input, str):
        return messages + [{"role": "user", "content": request.input}]
    for index, item in enumerate(request.input):
        messages.append(_item_message(index, item, messages))
    return [m for m in messages if m is not None]


def _item_message(index: int, item: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = "\n".join(part.get("text", "") for part in content
                                if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"))
        if item.get("role") not in ("user", "assistant", "system", "developer") or not isinstance(content, str):
            raise APIError(f"input[{index}]: a message needs a role (user, assistant, system, developer) and text "
                           f"content", param="input")
        return {"role": item["role"], "content": content}
    if kind == "function_call":
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = json.dumps(output)
        return {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output}
    raise APIError(f"input[{index}]: items of type {kind!r} are not supported (message, function_call, "
                   f"function_call_output are)", param="input")


def _chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    if UNSERVED_INCLUDE in (request.include or ()):
        raise APIError(f"include {UNSERVED_INCLUDE!r} is not supported: responses carry no logprobs here (the chat "
                       f"completions route does)", param="include")
    body: dict[str, Any] = {"model": request.model, "messages": messages, "temperature": request.temperature,
                            "top_p": request.top_p, "parallel_tool_calls": request.parallel_tool_calls}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in request.tools]
    if request.tool_choice is not None:
        choice = request.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice.name}}
    if "pic_backend" in request.model_fields_set:
        body["pic_backend"] = request.pic_backend
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from exc


class ResponsesAPI:
    """The routes, over the server's client, output settings, tokenizing thread and metrics."""

    def __init__(self, client: EngineClient, model_name: str, settings: OutputSettings,
                 in_worker: Callable[[Callable[[], Any]], Awaitable[Any]], metrics: ServerMetrics,
                 store: ResponseStore | None = None):
        self.client, self.model_name, self.settings = client, model_name, settings
        self.in_worker, self.metrics = in_worker, metrics
        self.store = store or ResponseStore()

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/responses")
        async def create(body: ResponsesRequest) -> Response:
            return await self.create(body)

        @app.get("/v1/responses/{response_id}")
        async def retrieve(response_id: str) -> dict[str, Any]:
            return self.store.body(response_id)

    async def create(self, request: ResponsesRequest) -> Response:
        arrival = time.perf_counter()
        if request.model != self.model_name:
            raise APIError(f"model {request.model!r} does not exist; this server serves {self.model_name!r}",
                           status=404, param="model", code="model_not_found")
        warn_ignored_fields(request)
        history = self.store.messages(request.previous_response_id) if request.previous_response_id else []
        messages = chat_messages(request, history)
        chat = _chat_request(request, messages)
        engine_input = await self.in_worker(lambda: chat_input(chat, self.client.tokenizer, self.client.max_model_len,
                                                               self.settings))
        response = _Response(request, self.model_name, engine_input.form.tool_parser)
        stream = self.metrics.timed(self.client.generate(response.id, engine_input.prompts[0], engine_input.params,
                                                         engine_input.pic_backend), arrival)
        first = await _first(stream, self.client, response.id)
        self.metrics.on_first_output(first, time.perf_counter() - arrival)
        if request.stream:
            return StreamingResponse(self._events(response, first, stream, messages),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        final = first
        try:
            async for final in stream:
                pass
        except EngineError as exc:
            raise APIError(str(exc), status=500, type=INTERNAL_ERROR, code="engine_error") from exc
        self.metrics.on_request_end(ENDPOINT, "ok", [final])
        body = response.body(final)
        self._remember(request, response, messages, final, body)
        return JSONResponse(body)

    async def _events(self, response: _Response, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                      messages: list[dict[str, Any]]) -> AsyncIterator[str]:
        events = _EventStream(response)
        status, output = "aborted", first  # until the stream ends, one way or another
        try:
            for event in events.opening():
                yield event
            output = first
            for event in events.update(first):
                yield event
            if not first.finished:
                async for output in stream:
                    for event in events.update(output):
                        yield event
            body = response.body(output)
            self._remember(response.request, response, messages, output, body)
            for event in events.closing(body):
                yield event
            status = "ok"
        except EngineError as exc:
            status = "error"
            yield events.event("error", {"code": "engine_error", "message": str(exc), "param": None})
        finally:
            await stream.aclose()
            self.client.abort(response.id)
            self.metrics.on_request_end(ENDPOINT, status, [output] if status == "ok" else [])

    def _remember(self, request: ResponsesRequest, response: _Response, messages: list[dict[str, Any]],
                  final: RequestOutput, body: dict[str, Any]) -> None:
        if request.store:
            self.store.put(response.id, messages + [response.assistant_message(final)], body)


async def _first(stream: AsyncIterator[RequestOutput], client: EngineClient, request_id: str) -> RequestOutput:
    try:
        return await anext(stream)
    except ValueError as exc:
        await stream.aclose()
        raise APIError(str(exc)) from exc
    except EngineError as exc:
        await stream.aclose()
        raise APIError(str(exc), status=500, type=INTERNAL_ERROR, code="engine_error") from exc
    except BaseException:
        client.abort(request_id)
        await stream.aclose()
        raise


class _Response:
    """One response's identity and how its output becomes Responses items."""

    def __init__(self, request: ResponsesRequest, model: str, tool_parser):
        self.request, self.model, self.tool_parser = request, model, tool_parser
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._call_ids: list[tuple[str, str]] = []  # (item id, call id) per tool call, in order

    def call_ids(self, number: int) -> tuple[str, str]:
        while len(self._call_ids) <= number:
            self._call_ids.append((f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex[:24]}"))
        return self._call_ids[number]

    def parsed(self, final: RequestOutput) -> tuple[str | None, list]:
        completion = final.outputs[0]
        if self.tool_parser is None:
            return completion.text, []
        parsed = self.tool_parser.parse(completion.text, truncated=completion.finish_reason == "length")
        return parsed.content, list(parsed.calls)

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def call_item(self, number: int, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        item_id, call_id = self.call_ids(number)
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    def body(self, final: RequestOutput | None, status: str | None = None) -> dict[str, Any]:
        request = self.request
        output, usage, incomplete = [], None, None
        if final is not None:
            content, calls = self.parsed(final)
            if content:
                output.append(self.message_item(content))
            output += [self.call_item(i, c.name, c.arguments) for i, c in enumerate(calls)]
            num_prompt, num_output = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
            usage = {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": cached_tokens(final)},
                     "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": num_prompt + num_output}
            if final.outputs[0].finish_reason == "length":
                incomplete = {"reason": "max_output_tokens"}
            status = status or ("incomplete" if incomplete else "completed")
        tools = [{"type": "function", **t.model_dump(exclude={"type"})} for t in request.tools or []]
        choice = request.tool_choice or ("auto" if request.tools else "none")
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status or "in_progress",
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "metadata": request.metadata or {},
                "parallel_tool_calls": request.parallel_tool_calls,
                "previous_response_id": request.previous_response_id,
                "temperature": request.temperature, "top_p": request.top_p, "store": request.store,
                "text": {"format": {"type": "text"}}, "tool_choice": choice if isinstance(choice, str) else
                choice.model_dump(), "tools": tools, "truncation": "disabled"}

    def assistant_message(self, final: RequestOutput) -> dict[str, Any]:
        content, calls = self.parsed(final)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": self.call_ids(i)[1], "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(calls)]
        return message


class _EventStream:
    """A response's server-sent events, numbered by ``sequence_number``."""

    def __init__(self, response: _Response):
        self.response = response
        self._number = 0
        self._text = TextDeltas(())
        self._tools = ToolCallDeltas(response.tool_parser) if response.tool_parser is not None else None
        self._sent_text = ""
        self._message_open = False
        self._items: list[dict[str, Any]] = []  # output items done, in order
        self._call_name, self._call_arguments = "", ""  # the function call being streamed

    def event(self, kind: str, payload: dict[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self._number, **payload}
        self._number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def opening(self) -> list[str]:
        body = self.response.body(None)
        return [self.event("response.created", {"response": body}),
                self.event("response.in_progress", {"response": body})]

    def update(self, output: RequestOutput) -> list[str]:
        completion = output.outputs[0]
        finished = completion.finish_reason is not None
        if self._tools is None:
            content, calls = self._text.next(completion.text, finished), []
        else:
            content, calls = self._tools.next(self._text.visible(completion.text, finished), finished,
                                              truncated=completion.finish_reason == "length")
        events = self._text_events(content) if content else []
        if calls or finished:
            events += self._close_message()
        for call in calls:
            events += self._call_events(call)
        if finished and self._call_name:  # cut by max_output_tokens while writing a call
            events += self._close_call(self._tools.num_calls - 1, "incomplete")
        return events

    def _text_events(self, delta: str) -> list[str]:
        events = []
        if not self._message_open:
            self._message_open = True
            events += [self.event("response.output_item.added", {"output_index": len(self._items),
                                                                 "item": self.response.message_item("", "in_progress")}),
                       self.event("response.content_part.added", {
                           "item_id": self.response.message_id, "output_index": len(self._items), "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})]
        self._sent_text += delta
        events.append(self.event("response.output_text.delta", {
            "item_id": self.response.message_id, "output_index": len(self._items), "content_index": 0,
            "delta": delta, "logprobs": []}))
        return events

    def _close_message(self) -> list[str]:
        if not self._message_open:
            return []
        self._message_open = False
        where = {"item_id": self.response.message_id, "output_index": len(self._items), "content_index": 0}
        item = self.response.message_item(self._sent_text)
        events = [self.event("response.output_text.done", {**where, "text": self._sent_text, "logprobs": []}),
                  self.event("response.content_part.done", {**where, "part": item["content"][0]}),
                  self.event("response.output_item.done", {"output_index": len(self._items), "item": item})]
        self._items.append(item)
        return events

    def _call_events(self, call: CallDelta) -> list[str]:
        """A call's item opens with its first delta, its arguments stream, and it closes once whole."""
        index, events = len(self._items), []
        if call.name is not None:
            self._call_name, self._call_arguments = call.name, ""
            item = self.response.call_item(call.number, call.name, "", "in_progress")
            events.append(self.event("response.output_item.added", {"output_index": index, "item": item}))
        if call.arguments:
            self._call_arguments += call.arguments
            item_id = self.response.call_ids(call.number)[0]
            events.append(self.event("response.function_call_arguments.delta", {
                "item_id": item_id, "output_index": index, "delta": call.arguments}))
        return events + (self._close_call(call.number, "completed") if call.complete else [])

    def _close_call(self, number: int, status: str) -> list[str]:
        index = len(self._items)
        item = self.response.call_item(number, self._call_name, self._call_arguments, status)
        self._items.append(item)
        self._call_name, self._call_arguments = "", ""
        return [self.event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                     "arguments": item["arguments"]}),
                self.event("response.output_item.done", {"output_index": index, "item": item})]

    def closing(self, body: dict[str, Any]) -> list[str]:
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self.event(kind, {"response": body})]
