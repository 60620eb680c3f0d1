"""The OpenAI-compatible HTTP API over any ``EngineClient``: ``build_app(client, model_name)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with ``"stream": true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

A request is validated and tokenized, then its first output is awaited before any status is sent, so every
invalid request (including what only the engine can check) is a 400 and never a half-open stream. After
that a stream reports an engine failure as an error event followed by ``[DONE]``. A client that goes away
(streaming or not) has its request aborted in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.server.engine_client import EngineClient, EngineDeadError, EngineError
from nebula_engine.server.errors import INTERNAL_ERROR, APIError, from_validation_errors
from nebula_engine.server.inputs import EngineInput, chat_input, completion_input
from nebula_engine.server.metrics import ServerMetrics
from nebula_engine.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from nebula_engine.server.responses import (ChatCompletionStream, CompletionStream, chat_response,
                                            completion_response)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}  # path -> metric label


def build_app(client: EngineClient, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The app; ``app.state.metrics`` is its ``ServerMetrics`` (``register`` more collectors there). With
    ``api_key``, every ``/v1/*`` route wants ``Authorization: Bearer <api_key>`` (else an OpenAI-style 401)."""
    app = FastAPI(title="nebula-engine", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(client.stats)
    app.state.metrics = metrics
    server = _Server(client, model_name, metrics)
    _add_error_handlers(app, metrics)
    if api_key is not None:
        _require_api_key(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        alive = client.stats().alive
        return Response(status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=client.max_model_len)])

    @app.get("/metrics")
    async def scrape() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await server.serve(raw, body, "completions", "cmpl", "prompt",
                                  lambda: completion_input(body, client.tokenizer, client.max_model_len))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await server.serve(raw, body, "chat_completions", "chatcmpl", "messages",
                                  lambda: chat_input(body, client.tokenizer, client.max_model_len))

    return app


class _Server:
    def __init__(self, client: EngineClient, model_name: str, metrics: ServerMetrics):
        self.client, self.model_name, self.metrics = client, model_name, metrics

    async def serve(self, raw: Request, body: CompletionRequest | ChatCompletionRequest, endpoint: str,
                    id_prefix: str, prompt_param: str, make_input: Callable[[], EngineInput]) -> Response:
        arrival = time.perf_counter()
        if body.model != self.model_name:
            raise APIError(f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        engine_input = make_input()
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        route = {"route": engine_input.route} if engine_input.route is not None else {}
        stream = self.client.generate(request_id, engine_input.prompt, engine_input.params, engine_input.pic_backend,
                                      **route)
        first = await self._first_output(stream)
        self.metrics.on_first_output(first, time.perf_counter() - arrival)
        if body.stream:
            stream_format = (CompletionStream if endpoint == "completions" else ChatCompletionStream)(
                request_id, self.model_name, engine_input.params.stop, body.include_usage_in_stream)
            events = self._events(stream_format, first, stream, request_id, endpoint)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        final = await self._last_output_unless_disconnected(raw, first, stream, endpoint)
        if final is None:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        self.metrics.on_request_end(endpoint, "ok", final)
        render = completion_response if endpoint == "completions" else chat_response
        return JSONResponse(render(request_id, self.model_name, final).model_dump())

    @staticmethod
    async def _first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        try:
            return await anext(stream)
        except ValueError as exc:  # the engine's own checks (vocabulary, PIC backend, ...): field unknown here
            raise APIError(str(exc)) from exc
        except EngineError as exc:
            raise _engine_failure(exc) from exc

    async def _events(self, stream_format: CompletionStream, first: RequestOutput,
                      stream: AsyncIterator[RequestOutput], request_id: str, endpoint: str) -> AsyncIterator[str]:
        output, status = first, "aborted"  # unless we reach the end: the client left and cancelled us
        try:
            for event in stream_format.opening():
                yield event
            while True:
                for event in stream_format.events(output):
                    yield event
                if output.finished:
                    break
                output = await anext(stream)
            for event in stream_format.closing(output):
                yield event
            status = "ok"
        except EngineError as exc:
            status = "error"
            yield _engine_failure(exc).sse_event()
            yield "data: [DONE]\n\n"
        finally:
            self.client.abort(request_id)  # no-op once finished; a sync call, safe inside a cancelled scope
            self.metrics.on_request_end(endpoint, status, output)

    async def _last_output_unless_disconnected(self, raw: Request, first: RequestOutput,
                                               stream: AsyncIterator[RequestOutput],
                                               endpoint: str) -> RequestOutput | None:
        """The finished output, or None (request aborted) if the client disconnects first."""
        if first.finished:
            return first
        collect = asyncio.ensure_future(_last_output(first, stream))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait((collect, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            collect.cancel()  # no-op when done; otherwise the generator's cleanup aborts the request
        if not collect.done() or collect.cancelled():
            self.metrics.on_request_end(endpoint, "aborted")
            return None
        try:
            return collect.result()
        except EngineError as exc:
            raise _engine_failure(exc) from exc


async def _last_output(output: RequestOutput, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for output in stream:
        pass
    return output


async def _wait_for_disconnect(raw: Request) -> None:
    # the body is already read, so the server's next message is the disconnect (or never comes)
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _require_api_key(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return APIError("invalid or missing API key: send 'Authorization: Bearer <key>'", status=401,
                                code="invalid_api_key").response()
        return await call_next(request)


def _engine_failure(exc: EngineError) -> APIError:
    status = 503 if isinstance(exc, EngineDeadError) else 500
    return APIError(str(exc), status=status, type=INTERNAL_ERROR, code="engine_error")


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def respond(request: Request, error: APIError) -> JSONResponse:
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            metrics.on_request_end(endpoint, "invalid" if error.status < 500 else "error")
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, from_validation_errors(exc.errors()))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, APIError(str(exc.detail), status=exc.status_code, code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, APIError(f"internal error: {exc!r}", status=500, type=INTERNAL_ERROR))
