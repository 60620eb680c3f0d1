"""ASGI guards in front of the API: the API key on ``/v1/*``, ``/tokenize`` and ``/detokenize``, and the request-body size limit.

Both answer before the body is parsed (the key check before a byte of it is read), with OpenAI-shaped errors.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Awaitable, Callable, MutableMapping

from nebula_engine.server.errors import APIError

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_PREFIX = "/v1"  # what the key guards; /health and /metrics stay open for probes and scrapers
GUARDED_ROOT_ROUTES = ("/tokenize", "/detokenize")  # vLLM's paths, outside /v1: model work, so guarded too


class APIKeyGuard:
    """Every ``/v1`` request (and ``/tokenize``, ``/detokenize``) needs ``Authorization: Bearer <key>`` (vLLM's ``--api-key``), else a 401.

    Keys are compared as SHA-256 digests with ``hmac.compare_digest``: constant time, whatever their lengths."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("an API key must not be empty")
        self.app = app
        self._digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(str(scope["path"])) and not self._authorized(scope):
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
    otherwise as soon as the bytes received pass the limit (chunked uploads). An accepted body is handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _respond(send, self._too_large())
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _respond(send, self._too_large())
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> APIError:
        return APIError(f"request body is larger than this server's limit of {self.max_bytes} bytes "
                        "(--max-request-bytes)", status=413, code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _guarded(path: str) -> bool:
    return path == API_PREFIX or path.startswith(API_PREFIX + "/") or path in GUARDED_ROOT_ROUTES


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
