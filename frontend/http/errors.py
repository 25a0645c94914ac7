"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the gateway answers is an `APIError` (or becomes one in `app.py`'s
exception handlers), so clients written against OpenAI's API (the `openai` package
maps status codes to exception classes) see familiar statuses and bodies:

| status | when                                                        | type                    |
|--------|-------------------------------------------------------------|-------------------------|
| 400    | a malformed body or a value the engine rejects (`param`)    | invalid_request_error   |
| 404    | an unknown model or route                                   | invalid_request_error   |
| 429    | the engine's queue is full (`Retry-After`)                  | rate_limit_error        |
| 500    | the engine accepted the request but could not finish it     | server_error            |
| 503    | the engine is unreachable or died (EngineDeadError)         | service_unavailable     |
"""
from __future__ import annotations

import json
import math

from starlette.responses import Response

from engine.protocol import Rejected

#: the engine's `Rejected.field` → the OpenAI request's parameter it came from
ENGINE_FIELD_TO_PARAM = {"height": "size", "width": "size", "output": "output_format",
                         "params": None, "request_id": None}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream whose status line is already sent."""
        return b"event: error\ndata: " + json.dumps({"type": "error", **self.body()}).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = "not_found") -> APIError:
    return APIError(404, message, param=param, code=code)


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the diffslot engine is unavailable: {reason}", type="service_unavailable",
                    code="engine_unavailable")


def from_rejected(result: Rejected) -> APIError:
    """Rejected → 429 (with Retry-After) when the engine says to retry, else 400 naming the field."""
    if result.retry_after_s > 0:
        seconds = result.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}
        return APIError(429, f"the engine is busy ({result.reason}); retry after {seconds:g}s",
                        type="rate_limit_error", code="engine_busy", headers=headers)
    param = ENGINE_FIELD_TO_PARAM.get(result.field, result.field) if result.field else None
    message = result.reason if not param or result.reason.startswith(param) else f"{param}: {result.reason}"
    return bad_request(message, param)
