"""Guards in front of the API: the API key on every route but the probes', the request-body size limit and
deadline (ASGI middleware), the request-head deadline (a uvicorn protocol), and the per-request cost caps.

The middleware answers before the body is parsed (the key check before a byte of it is read), with OpenAI-shaped
errors.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import TYPE_CHECKING, Awaitable, Callable, MutableMapping

from nebula_engine.server.errors import APIError
from nebula_engine.server.limits import DEFAULT_BODY_TIMEOUT_S, ClientLimits

if TYPE_CHECKING:
    from nebula_engine.server.inputs import EngineInput

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROBE_ROUTES = ("/health", "/metrics")  # open for load balancers and scrapers unless told otherwise


class APIKeyGuard:
    """Every request needs ``Authorization: Bearer <key>`` (vLLM's ``--api-key``), else a 401, except those to
    ``open_routes`` (``/health`` and, unless the metrics are protected too, ``/metrics``). So ``/v1/*``, vLLM's
    ``/tokenize`` and ``/detokenize``, a cluster peer's ``/cluster``, ``/openapi.json`` and any route added later
    are guarded, and an unknown path tells nothing without the key.

    Keys are compared as SHA-256 digests with ``hmac.compare_digest``: constant time, whatever their lengths."""

    def __init__(self, app: ASGIApp, api_key: str, open_routes: tuple[str, ...] = PROBE_ROUTES):
        if not api_key:
            raise ValueError("an API key must not be empty")
        self.app = app
        self.open_routes = frozenset(open_routes)
        self._digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and str(scope["path"]) not in self.open_routes
        if guarded and not self._authorized(scope):
            error = APIError("invalid or missing API key: send it as 'Authorization: Bearer <key>'", status=401,
                             code="invalid_api_key")
            await _respond(send, error, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        # always compare, so a malformed header takes as long as a wrong key
        matches = hmac.compare_digest(_digest(token.strip()), self._digest)
        return scheme.lower() == b"bearer" and matches


class BodySizeLimit:
    """Reject a request whose body exceeds ``max_bytes`` with a 413: at once when its Content-Length says so,
    otherwise as soon as the bytes received pass the limit (chunked uploads). A body that has not arrived whole
    ``timeout_s`` after its head is a 408 (a slow or stalled client holds no connection for longer). An accepted
    body is handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"the body timeout must be positive, got {timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _respond(send, self._too_large())
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._body(receive)
        except TimeoutError:
            await _respond(send, self._too_slow(), [(b"connection", b"close")])
            return
        if body is None:
            return  # the client left before its body was complete: nobody to answer
        if isinstance(body, APIError):
            await _respond(send, body)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _body(self, receive: Receive) -> bytes | APIError | None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return self._too_large()
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        return b"".join(chunks)

    def _too_slow(self) -> APIError:
        return APIError(f"the request body did not arrive within {self.timeout_s:g} s (--body-timeout); send it "
                        "whole and without pauses", status=408, code="request_timeout")

    def _too_large(self) -> APIError:
        return APIError(f"request body is larger than this server's limit of {self.max_bytes} bytes "
                        "(--max-request-bytes)", status=413, code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None


async def _respond(send: Send, error: APIError, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error.body().model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def check_cost(engine_input: EngineInput, limits: ClientLimits, max_model_len: int) -> None:
    """A 400 naming the limit when any prompt of the request asks for more work than ``limits`` allow."""
    params = engine_input.params
    for prompt in engine_input.prompts:
        num_prompt = len(getattr(prompt, "token_ids", prompt))
        violation = limits.cost_violation(params.n, params.max_tokens, num_prompt, max_model_len)
        if violation is not None:
            message, param = violation
            raise APIError(message, param=param, code="request_too_costly")


def header_timeout_protocol(timeout_s: float, base: type | None = None) -> type:
    """A uvicorn HTTP protocol (``uvicorn.Config(http=...)``) that closes a connection whose request head (request
    line and headers) has not arrived whole ``timeout_s`` after the connection opened or its last response ended.

    uvicorn itself bounds only an idle keep-alive connection, and only until its first byte: a client dribbling a
    head a byte at a time holds its connection forever. ``base``: the protocol to extend (default: uvicorn's
    ``auto``, httptools when installed, else h11)."""
    if not timeout_s > 0:
        raise ValueError(f"the header timeout must be positive, got {timeout_s}")
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class HeaderTimeoutProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's head arrived whole
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # no pipelined request started behind it
                self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
