"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}``, for every failure path.

The policy: a 4xx says what was wrong with the request, naming the field, in terms of the request (never a
repr of server code). A 500 says only what the client can do and names an id; what happened (the exception,
its traceback) goes to the server log under that id (``internal_error``). A 503 says the server cannot serve now.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Sequence

from fastapi.responses import JSONResponse

from nebula_engine.server.protocol import ErrorInfo, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
INTERNAL_ERROR = "internal_server_error"

logger = logging.getLogger(__name__)
_CODE_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")  # <function f at 0x7f...>: an address, not a field


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = INVALID_REQUEST):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)

    def sse_event(self) -> str:
        """The error as a stream event, for failures after a stream's 200 status has been sent."""
        return f"data: {json.dumps(self.body().model_dump())}\n\n"


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> APIError:
    """A pydantic / FastAPI error list -> one 400 naming the first offending field."""
    if any(e["type"] == "json_invalid" for e in errors):
        return APIError(f"request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}".rstrip(": "),
                        param=None, code="json_invalid")
    parts, params = [], []
    for error in errors[:4]:
        loc = [str(p) for p in error["loc"] if p != "body" and _is_request_location(p)]
        param = error.get("ctx", {}).get("param") or (loc[0] if loc else None)
        params.append(param)
        message = _CODE_REPR.sub("<code>", str(error["msg"]))
        if loc:
            parts.append(f"{'.'.join(loc)}: {message}")
        else:  # a whole-body check: its message names its field itself
            parts.append(message if param else f"request body: {message}")
    return APIError("; ".join(parts), param=params[0], code=errors[0]["type"])


def _is_request_location(part: Any) -> bool:
    """Whether a pydantic location part is a field name or an index of the request, not the tag of the union
    member or validator chain that was tried (``function-after[functools.partial(<function ...>)]``, ``list[str]``)."""
    return isinstance(part, int) or not any(c in str(part) for c in "[(<> ")


def internal_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """A 500 that names ``request_id`` (or a fresh error id) and what the client can do; ``exc`` and its
    traceback go to the log under that id, never to the client."""
    ident = request_id or f"error-{uuid.uuid4().hex[:12]}"
    logger.error("internal error (id %s): %s: %s", ident, type(exc).__name__, exc, exc_info=exc)
    return APIError(f"internal error (id {ident}): retry the request; if it keeps failing, give this id to the "
                    "server's operator (the server log has the details)", status=500, type=INTERNAL_ERROR,
                    code="internal_error")


def unavailable(reason: str, request_id: str | None = None) -> APIError:
    """A 503: the server cannot serve now (no engine, no quorum); ``reason`` is written for users."""
    suffix = f" (id {request_id})" if request_id else ""
    return APIError(f"service unavailable: {reason}; retry later{suffix}", status=503, type=INTERNAL_ERROR,
                    code="service_unavailable")
