"""OpenAI-shaped errors: one exception type and one body format for every failure.

Clients written against OpenAI parse ``{"error": {"message", "type", "param", "code"}}``
and branch on the HTTP status, so every path that can fail (validation, the scheduler's
gRPC status, an unknown route) ends up as an ``APIError`` and is rendered here, never as
a stack trace or FastAPI's default ``{"detail": ...}``.
"""

from __future__ import annotations

import math
from typing import Any

import grpc

from common.errors import RETRY_PUSHBACK_KEY, SuperInferError

# Seconds a client should wait before retrying a 429/503.
RETRY_AFTER_S = 1

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error with the HTTP status, OpenAI type/code/param and extra headers to send."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_BY_STATUS.get(self.status, grpc.StatusCode.INTERNAL)

    @property
    def grpc_trailers(self) -> tuple[tuple[str, str], ...]:
        """The retry hint of a 429/503 for gRPC clients, as gRPC's own pushback key."""
        retry_after = self.headers.get("Retry-After")
        if retry_after is None or not retry_after.isdigit():
            return ()
        return ((RETRY_PUSHBACK_KEY, str(int(retry_after) * 1000)),)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="scheduler_unavailable")


def overloaded(message: str) -> APIError:
    return APIError(429, message, code="overloaded")


def from_superinfer(err: SuperInferError, param: str | None = None) -> APIError:
    """Shared library errors already carry their status and code."""
    return APIError(err.http_status, err.message, param=param, code=err.code)


# Scheduler status → (HTTP status, code). Anything unlisted is the gateway's 500.
_HTTP_BY_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "context_length_exceeded"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "duplicate_request_id"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "scheduler_unavailable"),
    grpc.StatusCode.CANCELLED: (503, "scheduler_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "scheduler_timeout"),
}

_GRPC_BY_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def from_grpc(err: grpc.aio.AioRpcError) -> APIError:
    """Translate the scheduler's gRPC status; its details become the message."""
    return from_status(err.code(), err.details(), _retry_pushback_s(err))


def from_status(grpc_code: grpc.StatusCode, details: str | None,
                pushback_s: int | None = None) -> APIError:
    """A scheduler status (a call's, or one its token stream carries), as the client sees it."""
    status, code = _HTTP_BY_GRPC.get(grpc_code, (500, "scheduler_error"))
    detail = details or grpc_code.name
    if status == 503:
        detail = f"the scheduler is unavailable ({detail}); retry shortly"
    elif status == 500:
        detail = f"the scheduler failed: {detail}"
    headers = {}
    if pushback_s is not None and status in (429, 503):
        headers["Retry-After"] = str(pushback_s)
    return APIError(status, detail, code=code, headers=headers)


def _retry_pushback_s(err: grpc.aio.AioRpcError) -> int | None:
    """The scheduler's retry hint in whole seconds (at least 1), if it sent one."""
    for key, value in err.trailing_metadata() or ():
        if key == RETRY_PUSHBACK_KEY and isinstance(value, str) and value.isdigit():
            return max(1, math.ceil(int(value) / 1000))
    return None
