"""`/health`, `/livez` and `/metrics`: what load balancers, supervisors and Prometheus poll.

Health (readiness) asks the scheduler every time (a cached "ok" would hide a scheduler
restart), and is only healthy once the tokenizer is loaded too, i.e. when a request would
work. `/livez` (liveness) only says the gateway's event loop runs: it touches nothing
else, so a scheduler outage never makes a working gateway look dead.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.context import GatewayContext
from gateway.errors import APIError

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ctx: GatewayContext = request.app.state.ctx
    try:
        await ctx.backend.model_info()
        model = await ctx.backend.model()
    except APIError as e:
        unhealthy = e if e.status == 503 else APIError(503, e.message, code=e.code)
        return JSONResponse(unhealthy.body(), status_code=503, headers=unhealthy.headers)
    return JSONResponse({"status": "ok", "model": model.served_name, "in_flight": len(ctx.active)})


@router.get("/livez")
async def livez() -> JSONResponse:
    return JSONResponse({"status": "alive"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx: GatewayContext = request.app.state.ctx
    try:
        stats = await ctx.backend.stats()
    except APIError:
        stats = None  # still export the gateway's own series, with scheduler_up 0
    return Response(ctx.metrics.render(stats, ctx.backend.served_name),
                    media_type=CONTENT_TYPE_LATEST)
