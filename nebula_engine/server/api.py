"""The OpenAI-compatible HTTP API over any ``EngineClient``: ``build_app(client, model_name, api_key=...)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with ``"stream": true``),
``POST /v1/responses`` and ``GET /v1/responses/{id}`` (``openai_responses``), ``GET /v1/models``,
``GET /v1/models/{id}``, vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, ``GET /health``,
``GET /metrics``. With an API key every route but ``/health`` (and, unless protected too, ``/metrics``) needs it
(``guards.APIKeyGuard``); a body over ``max_request_bytes`` is a 413 before it is parsed, one that arrives too
slowly a 408 (``guards.BodySizeLimit``); a request asking for more work than ``limits.ClientLimits`` allow a 400.

A request is validated and tokenized (in a worker thread: a long prompt must not stall the event loop, which
also answers ``/health``), then its first output is awaited before any status is sent, so every invalid
request (including what only the engine can check) is a 400 and never a half-open stream. After that a stream
reports an engine failure as an error event followed by ``[DONE]``. A client that goes away (streaming or not)
has its request aborted in the engine. An unexpected server error (an engine failure included) is a 500 whose body
names only an id and what to do; the exception goes to the log under that id (``errors.internal_error``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.server.engine_client import EngineClient, EngineDeadError, EngineError
from nebula_engine.server.errors import APIError, from_validation_errors, internal_error, unavailable
from nebula_engine.server.guards import PROBE_ROUTES, APIKeyGuard, BodySizeLimit, check_cost
from nebula_engine.server.inputs import EngineInput, OutputSettings, chat_input, completion_input
from nebula_engine.server.limits import DEFAULT_MAX_REQUEST_BYTES, ClientLimits
from nebula_engine.server.protocol import MAX_LOGPROBS
from nebula_engine.server.metrics import ServerMetrics, package_version
from nebula_engine.server.openai_responses import ResponsesAPI
from nebula_engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                           TokenizeResponse)
from nebula_engine.server.responses import (ChatCompletionStream, CompletionStream, chat_response,
                                            completion_response)
from nebula_engine.server.tokenize import detokenize_request, tokenize_request
from nebula_engine.server.tool_parsers import parser_for_template, tool_parser

logger = logging.getLogger(__name__)
T = TypeVar("T")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
             "/v1/responses": "responses"}  # path -> metric label


def build_app(client: EngineClient, model_name: str, *, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_call_parser: str | None = None,
              disable_any_whitespace: bool = False, max_logprobs: int = MAX_LOGPROBS,
              limits: ClientLimits = ClientLimits(), open_metrics: bool = True) -> FastAPI:
    """The app; ``app.state.metrics`` is its ``ServerMetrics`` (``register`` more collectors there).

    ``tool_call_parser``: the format of tool calls in the model's output (``tool_parsers.TOOL_PARSERS``); None:
    recognised from the model's chat template. ``disable_any_whitespace``: constrained JSON outputs
    (``response_format``, forced tool calls) are compact (vLLM's structured-outputs option). ``max_logprobs``:
    the most logprobs per token a request may ask (vLLM's ``--max-logprobs``).

    ``api_key``: when given, every route needs ``Authorization: Bearer <api_key>`` (401 otherwise) but ``/health``
    and, with ``open_metrics``, ``/metrics`` (``guards.APIKeyGuard``). ``max_request_bytes``: a larger request
    body is a 413. ``limits``: how long a body may take to arrive (408) and the per-request cost caps (400)."""
    app = FastAPI(title="nebula-engine", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(client.stats, model_name)
    app.state.metrics = metrics
    server = _Server(client, model_name, metrics, limits)
    parser = tool_parser(tool_call_parser) if tool_call_parser else parser_for_template(client.tokenizer.chat_template)
    settings = OutputSettings(parser, disable_any_whitespace, max_logprobs)
    _add_error_handlers(app, metrics)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes, timeout_s=limits.body_timeout_s)
    if api_key is not None:  # added last: runs first, before the body is read
        app.add_middleware(APIKeyGuard, api_key=api_key, open_routes=PROBE_ROUTES if open_metrics else ("/health",))

    @app.get("/health")
    async def health() -> Response:
        alive = client.stats().alive
        return Response(status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=client.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id != model_name:
            raise APIError(f"model {model_id!r} does not exist; this server serves {model_name!r}", status=404,
                           param="model", code="model_not_found")
        return ModelCard(id=model_name, max_model_len=client.max_model_len)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/metrics")
    async def scrape() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await server.serve(raw, body, "completions", "cmpl",
                                  lambda: completion_input(body, client.tokenizer, client.max_model_len, settings))

    ResponsesAPI(client, model_name, settings, server.in_worker, metrics).add_routes(app)  # /v1/responses

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await server.serve(raw, body, "chat_completions", "chatcmpl",
                                  lambda: chat_input(body, client.tokenizer, client.max_model_len, settings))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        server.check_model(body.model)
        return await server.in_worker(lambda: tokenize_request(body, client.tokenizer, client.max_model_len))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(body.model)
        return await server.in_worker(lambda: detokenize_request(body, client.tokenizer))

    return app


class _Server:
    def __init__(self, client: EngineClient, model_name: str, metrics: ServerMetrics, limits: ClientLimits):
        self.client, self.model_name, self.metrics, self.limits = client, model_name, metrics, limits
        # one thread, as vLLM's tokenizer executor: requests are tokenized in arrival order, never concurrently
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="nebula-tokenize")

    async def in_worker(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, work)

    async def serve(self, raw: Request, body: CompletionRequest | ChatCompletionRequest, endpoint: str,
                    id_prefix: str, make_input: Callable[[], EngineInput]) -> Response:
        arrival = time.perf_counter()
        self.check_model(body.model)
        engine_input = await self.in_worker(make_input)
        check_cost(engine_input, self.limits, self.client.max_model_len)
        request_id = f"{id_prefix}-{engine_input.request_id or uuid.uuid4().hex}"
        request_ids = [request_id] if len(engine_input.prompts) == 1 else \
            [f"{request_id}-{i}" for i in range(len(engine_input.prompts))]  # a completions batch: one per prompt
        route = {"route": engine_input.route} if engine_input.route is not None else {}
        streams = [self.metrics.timed(self.client.generate(rid, prompt, engine_input.params, engine_input.pic_backend,
                                                           **route), arrival)
                   for rid, prompt in zip(request_ids, engine_input.prompts)]
        firsts = await self._first_outputs(streams, request_ids)
        for first in firsts:
            self.metrics.on_first_output(first, time.perf_counter() - arrival)
        n, form = engine_input.params.n, engine_input.form
        if body.stream:
            stream_format = (CompletionStream if endpoint == "completions" else ChatCompletionStream)(
                request_id, self.model_name, form, body.include_usage_in_stream, n, len(streams))
            events = self._events(stream_format, firsts, streams, request_ids, endpoint)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals = await self._last_outputs_unless_disconnected(raw, firsts, streams, request_ids, endpoint)
        if finals is None:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        self.metrics.on_request_end(endpoint, "ok", finals)
        if endpoint == "completions":
            response = completion_response(request_id, self.model_name, finals, form)
        else:
            response = chat_response(request_id, self.model_name, finals[0], form)
        return JSONResponse(response.model_dump())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"model {model!r} does not exist; this server serves {self.model_name!r}", status=404,
                           param="model", code="model_not_found")

    async def _first_outputs(self, streams: list[AsyncIterator[RequestOutput]],
                             request_ids: list[str]) -> list[RequestOutput]:
        """Each stream's first output, so that every invalid request is a 400; on any failure all are aborted."""
        try:
            return [await self._first_output(stream, request_id) for stream, request_id in zip(streams, request_ids)]
        except BaseException:
            for stream, request_id in zip(streams, request_ids):
                self.client.abort(request_id)
                await stream.aclose()
            raise

    @staticmethod
    async def _first_output(stream: AsyncIterator[RequestOutput], request_id: str) -> RequestOutput:
        try:
            return await anext(stream)
        except ValueError as exc:  # the engine's own checks (vocabulary, PIC backend, ...): field unknown here
            raise APIError(str(exc)) from exc
        except EngineError as exc:
            raise _engine_failure(exc, request_id) from exc

    async def _events(self, stream_format: CompletionStream, firsts: list[RequestOutput],
                      streams: list[AsyncIterator[RequestOutput]], request_ids: list[str],
                      endpoint: str) -> AsyncIterator[str]:
        finals, status = list(firsts), "aborted"  # unless we reach the end: the client left and cancelled us
        try:
            for event in stream_format.opening():
                yield event
            async for prompt_index, output in _merged(firsts, streams):
                finals[prompt_index] = output
                for event in stream_format.events(output, prompt_index):
                    yield event
            for event in stream_format.closing(finals):
                yield event
            status = "ok"
        except EngineError as exc:
            status = "error"
            yield _engine_failure(exc, request_ids[0]).sse_event()
            yield "data: [DONE]\n\n"
        except Exception as exc:  # a bug of ours: the client still gets an end, and no internals
            status = "error"
            yield internal_error(exc, request_ids[0]).sse_event()
            yield "data: [DONE]\n\n"
        finally:
            for request_id in request_ids:
                self.client.abort(request_id)  # no-op once finished; a sync call, safe inside a cancelled scope
            self.metrics.on_request_end(endpoint, status, finals)

    async def _last_outputs_unless_disconnected(self, raw: Request, firsts: list[RequestOutput],
                                                streams: list[AsyncIterator[RequestOutput]], request_ids: list[str],
                                                endpoint: str) -> list[RequestOutput] | None:
        """The finished outputs, or None (requests aborted) if the client disconnects first."""
        if all(first.finished for first in firsts):
            return firsts
        collect = asyncio.ensure_future(asyncio.gather(*(_last_output(f, s) for f, s in zip(firsts, streams))))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait((collect, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            collect.cancel()  # no-op when done; otherwise the generators' cleanup aborts the requests
        if not collect.done() or collect.cancelled():
            for request_id in request_ids:
                self.client.abort(request_id)
            self.metrics.on_request_end(endpoint, "aborted")
            return None
        try:
            return collect.result()
        except EngineError as exc:
            for request_id in request_ids:
                self.client.abort(request_id)
            raise _engine_failure(exc, request_ids[0]) from exc


async def _merged(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as each arrives, starting with the first outputs."""
    pending: dict[int, asyncio.Future] = {}
    try:
        for index, first in enumerate(firsts):
            yield index, first
            if not first.finished:
                pending[index] = asyncio.ensure_future(anext(streams[index]))
        while pending:
            await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
            for index, task in sorted(pending.items()):
                if not task.done():
                    continue
                output = task.result()
                del pending[index]
                yield index, output
                if not output.finished:
                    pending[index] = asyncio.ensure_future(anext(streams[index]))
    finally:
        for task in pending.values():
            task.cancel()


async def _last_output(output: RequestOutput, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    async for output in stream:
        pass
    return output


async def _wait_for_disconnect(raw: Request) -> None:
    # the body is already read, so the server's next message is the disconnect (or never comes)
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _engine_failure(exc: EngineError, request_id: str) -> APIError:
    """503 with the reason when no engine can serve (its messages are written for users); otherwise a 500 whose
    detail stays in the log (``errors.internal_error``)."""
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), request_id)
    return internal_error(exc, request_id)


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
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, internal_error(exc))
