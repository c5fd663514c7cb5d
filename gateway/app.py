"""The FastAPI application: routes, error rendering and the process lifespan.

The lifespan opens the scheduler channel and starts the client gRPC server inside
uvicorn's event loop (grpc.aio needs the loop that serves it), and warms up the model
facts in the background so the gateway can start before the scheduler is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import grpc_api, openai_routes, ops_routes, router_routes
from gateway.context import GatewayContext, GatewaySettings
from gateway.errors import APIError
from gateway.middleware import RequestContextMiddleware
from gateway.streaming import ClientDisconnected

# A lazy proxy, not get_logger(): a logger bound at import time would keep the default
# configuration instead of the one configure_logging() installs later.
log = structlog.get_logger()


def create_app(settings: GatewaySettings) -> FastAPI:
    """The app `settings` describe; a bad tenants file raises TenantsError (at start, the
    gateway exits with its message; on SIGHUP, the old file stays in force)."""
    ctx = GatewayContext.create(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.backend.start()
        grpc_server = None
        warm_up: asyncio.Task[None] | None = None
        try:
            if settings.grpc_port:
                grpc_server = await grpc_api.start_server(ctx, settings.host, settings.grpc_port)
            warm_up = asyncio.create_task(ctx.backend.warm_up())
            if ctx.tenants is not None:
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, ctx.tenants.reload)
            log.info("gateway started", scheduler=settings.scheduler_addr,
                     grpc_port=settings.grpc_port,
                     tenants=ctx.tenants.tenants.names if ctx.tenants else None)
            yield
        finally:
            if ctx.tenants is not None:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            if warm_up is not None:
                warm_up.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            await ctx.backend.close()
            log.info("gateway stopped")

    app = FastAPI(title="SuperInfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.include_router(openai_routes.router)
    app.include_router(ops_routes.router)
    app.include_router(router_routes.router)
    _add_error_handlers(app, ctx)
    app.add_middleware(
        RequestContextMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
        in_flight=ctx.in_flight, metrics=ctx.metrics, replica_id=settings.replica_id,
        tenants=ctx.tenants,
    )
    return app


def _add_error_handlers(app: FastAPI, ctx: GatewayContext) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request failed", status=exc.status, error=exc.message)
        else:
            log.info("request rejected", status=exc.status, param=exc.param, error=exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.url.path in openai_routes.GENERATION_PATHS:
            ctx.metrics.requests.labels("rejected").inc()
        return await api_error(request, validation_to_api_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        err = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        log.info("client disconnected")
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", path=request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        return JSONResponse(err.body(), status_code=500)


def validation_to_api_error(errors: Any) -> APIError:
    """FastAPI's 422 list → one OpenAI 400 naming the first bad field (``a.b[0].c``)."""
    first: dict[str, Any] = next(iter(errors), {"loc": ("body",), "msg": "invalid request"})
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    kind = first.get("type", "")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":  # its loc is a character offset, not a field
        param = None
        detail = (first.get("ctx") or {}).get("error", "")
        message = f"request body is not valid JSON ({detail})" if detail else "request body is not valid JSON"
    elif kind == "missing" and param is None:
        message = "request body is missing; send a JSON object"
    elif kind == "missing":
        message = f"missing required field '{param}'"
    elif param is None:
        message = f"request body must be a JSON object ({msg})"
    else:
        message = f"{param}: {msg}"
    return APIError(400, message, param=param, code="invalid_value" if param else "invalid_json")
