"""Per-request context: the X-Request-ID, its log binding, and the optional API key or
tenant (with a tenants file, the key names the tenant: 401 for none, the tenant's own
in-flight limit, and its x-ratelimit-* headers on every response; gateway/tenants.py).

It also bounds what a request may cost before any route runs: /v1/* requests take a slot
of the shared in-flight limit (429 past it) and their body is read here, counted as it
arrives, up to --max-body-bytes (413 past it, chunked uploads included).

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
from gateway.limits import DEFAULT_MAX_BODY_BYTES, InFlightLimit, body_too_large, read_body
from gateway.metrics import GatewayMetrics
from gateway.openai_routes import GENERATION_PATHS
from gateway.tenants import TenantGate

# A lazy proxy, not get_logger(): a logger bound at import time would keep the default
# configuration instead of the one configure_logging() installs later.
log = structlog.get_logger()

REQUEST_ID_HEADER = "x-request-id"
# Which replica answered (--replica-id): kept by a router that passes response headers on,
# so a client behind it can tell where each request went.
REPLICA_HEADER = "x-superinfer-replica"
# Not under /v1 but a client's request like those: the same key, size and in-flight limits.
_API_PATHS = frozenset({"/tokenize"})
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def valid_request_id(value: str) -> bool:
    return _REQUEST_ID_RE.fullmatch(value) is not None


class RequestContextMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None = None,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        in_flight: InFlightLimit | None = None,
        metrics: GatewayMetrics | None = None,
        replica_id: str = "",
        tenants: TenantGate | None = None,
    ) -> None:
        self.app = app
        self._tenants = tenants
        self._replica = [(REPLICA_HEADER.encode(), replica_id.encode())] if replica_id else []
        self._api_key = api_key.encode() if api_key else None
        self._max_body = max_body_bytes
        self._in_flight = in_flight or InFlightLimit(0)
        self._metrics = metrics

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
        api = scope["path"].startswith("/v1/") or scope["path"] in _API_PATHS
        tenant = None
        if error is None and self._api_key and api:
            error = check_api_key(headers.get(b"authorization"), self._api_key)
        if error is None and self._tenants is not None and api:
            try:
                tenant = self._tenants.identify(headers.get(b"authorization"))
            except APIError as e:
                error = e
        if error is None:
            error = _check_length(headers.get(b"content-length"), self._max_body)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrival"] = time.monotonic()
        state["tenant"] = tenant
        gate = self._tenants

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                extra = []
                if tenant is not None and gate is not None:
                    known = {k.lower() for k, _ in message["headers"]}
                    extra = [(k.encode(), v.encode()) for k, v in gate.headers(tenant).items()
                             if k.encode() not in known]
                message["headers"] = [
                    *message["headers"], (REQUEST_ID_HEADER.encode(), request_id.encode()),
                    *self._replica, *extra,
                ]
            await send(message)

        bound = {"request_id": request_id} | ({"tenant": tenant.name} if tenant else {})
        with structlog.contextvars.bound_contextvars(**bound):
            entered = False
            if error is None and api:
                try:
                    self._in_flight.acquire()
                    if tenant is not None and gate is not None:
                        try:
                            gate.enter(tenant)
                            entered = True
                        except APIError:
                            self._in_flight.release()
                            raise
                except APIError as e:
                    error = e
            if error is not None:
                await self._reject(scope, error, send_with_id)
                return
            try:
                if api:
                    body = await read_body(receive, self._max_body)
                    if isinstance(body, APIError):
                        await self._reject(scope, body, send_with_id)
                        return
                    receive = _replay(body, receive)
                await self.app(scope, receive, send_with_id)
            finally:
                if api:
                    self._in_flight.release()
                if entered and gate is not None and tenant is not None:
                    gate.leave(tenant)

    async def _reject(self, scope: Scope, error: APIError, send: Send) -> None:
        log.info("request rejected", status=error.status, code=error.code, path=scope["path"])
        if self._metrics is not None and scope["path"] in GENERATION_PATHS:
            self._metrics.requests.labels("rejected").inc()
        await _send_error(error, send)


def _replay(messages: tuple[Message, ...], receive: Receive) -> Receive:
    """Hand the already-read body to the app, then pass on what the client sends next."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def check_api_key(header: bytes | None, key: bytes) -> APIError | None:
    """None when ``header`` is 'Bearer <key>'; the compare takes the same time wherever
    the given token differs (it still reveals the key's length, as any compare does)."""
    scheme, _, token = (header or b"").partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
        return None
    return APIError(
        401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
    )


def _check_length(header: bytes | None, limit: int) -> APIError | None:
    if header is None:
        return None
    if not header.isdigit():
        return APIError(400, "Content-Length is not a number", code="invalid_content_length")
    if int(header) > limit:
        return body_too_large(limit)
    return None


async def _send_error(error: APIError, send: Send) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
