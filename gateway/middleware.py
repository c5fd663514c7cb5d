"""Per-request context: the X-Request-ID, its log binding, and the optional API key.

Written as plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers through
an extra task per request and gets in the way of streaming and disconnect detection.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

REQUEST_ID_HEADER = "x-request-id"
# Far above any prompt that fits a context window; refuses bodies that would only eat memory.
MAX_BODY_BYTES = 32 << 20
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def valid_request_id(value: str) -> bool:
    return _REQUEST_ID_RE.fullmatch(value) is not None


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None = None) -> None:
        self.app = app
        self._api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID_HEADER.encode())
        request_id = new_request_id()
        error: APIError | None = None
        if given is not None:
            text = given.decode("latin-1")
            if valid_request_id(text):
                request_id = text
            else:
                error = APIError(
                    400, "X-Request-ID must be 1-128 characters of A-Z a-z 0-9 . _ -",
                    param="X-Request-ID", code="invalid_request_id",
                )
        if error is None and self._api_key and scope["path"].startswith("/v1/"):
            error = _check_key(headers.get(b"authorization"), self._api_key)
        if error is None:
            error = _check_length(headers.get(b"content-length"))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrival"] = time.monotonic()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode())
                ]
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            if error is not None:
                await _send_error(error, send_with_id)
                return
            await self.app(scope, receive, send_with_id)



def _check_key(header: bytes | None, key: bytes) -> APIError | None:
    scheme, _, token = (header or b"").partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
        return None
    return APIError(
        401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
    )


def _check_length(header: bytes | None) -> APIError | None:
    if header is None:
        return None
    if not header.isdigit():
        return APIError(400, "Content-Length is not a number", code="invalid_content_length")
    if int(header) > MAX_BODY_BYTES:
        return APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    return None


async def _send_error(error: APIError, send: Send) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
