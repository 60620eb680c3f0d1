"""OpenAI-style error bodies, ``{"error": {"message", "type", "param", "code"}}``, for every failure path."""

from __future__ import annotations

import json
from typing import Any, Sequence

from fastapi.responses import JSONResponse

from nebula_engine.server.protocol import ErrorInfo, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
INTERNAL_ERROR = "internal_server_error"


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
        loc = [str(p) for p in error["loc"] if p != "body"]
        param = error.get("ctx", {}).get("param") or (loc[0] if loc else None)
        params.append(param)
        if loc:
            parts.append(f"{'.'.join(loc)}: {error['msg']}")
        else:  # a whole-body check: its message names its field itself
            parts.append(error["msg"] if param else f"request body: {error['msg']}")
    return APIError("; ".join(parts), param=params[0], code=errors[0]["type"])
