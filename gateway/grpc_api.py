"""The client-facing gRPC API (`proto/client.proto`, service SuperInfer).

It shares validation, tokenization, stop strings and cleanup with the REST routes
(conversion.py, generation.py) and runs on uvicorn's event loop, so both front doors see
the same in-flight table: a gRPC Abort can end a REST request by its id and vice versa.
Proto3 scalars cannot say "not set", so 0 means the default for max_tokens (up to the
context limit) and top_p (1.0); temperature 0 is greedy. With --api-key, every call needs
``authorization: Bearer <key>`` metadata (UNAUTHENTICATED otherwise), and Generate takes a
slot of the gateway's in-flight limit, like a REST request (RESOURCE_EXHAUSTED past it).
With a tenants file the key names the tenant, whose limits apply as on REST.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.tenants import Tenant
from common.wire import logprobs_to_proto
from gateway import conversion
from gateway.context import GatewayContext
from gateway.errors import APIError, invalid
from gateway.generation import Generation
from gateway.middleware import check_api_key, new_request_id, valid_request_id
from proto import client_pb2, client_pb2_grpc

# A lazy proxy, not get_logger(): a logger bound at import time would keep the default
# configuration instead of the one configure_logging() installs later.
log = structlog.get_logger()


class SuperInferServicer(client_pb2_grpc.SuperInferServicer):
    def __init__(self, ctx: GatewayContext) -> None:
        self._ctx = ctx

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: client_pb2.ClientGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[client_pb2.ClientGenerateEvent]:
        request_id = request.request_id or _metadata_request_id(context) or new_request_id()
        gate = self._ctx.tenants
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            tenant = None
            try:
                tenant = self._authorize(context)
                self._ctx.in_flight.acquire()
            except APIError as e:
                self._ctx.metrics.requests.labels("rejected").inc()
                await _abort(context, e)
                return
            if tenant is not None and gate is not None:
                structlog.contextvars.bind_contextvars(tenant=tenant.name)
                try:
                    gate.enter(tenant)
                except APIError as e:
                    self._ctx.in_flight.release()
                    self._ctx.metrics.requests.labels("rejected").inc()
                    await _abort(context, e)
                    return
            try:
                try:
                    gen = await self._prepare(request, request_id, tenant)
                except APIError as e:
                    self._ctx.metrics.requests.labels("rejected").inc()
                    await _abort(context, e)
                    return
                await context.send_initial_metadata((("x-request-id", request_id),))
                try:
                    sent_prompt = False
                    async for delta in gen.stream():
                        event = client_pb2.ClientGenerateEvent(
                            request_id=request_id,
                            text=delta.text,
                            token_ids=delta.token_ids,
                            finish_reason=delta.finish_reason or "",
                            prompt_tokens=gen.prompt_tokens,
                            completion_tokens=gen.completion_tokens,
                            index=delta.index,
                            logprobs=logprobs_to_proto(delta.logprobs),
                            cached_tokens=gen.cached_tokens,
                        )
                        if delta.index == 0 and not sent_prompt and gen.prompt_logprobs:
                            event.prompt_logprobs.extend(logprobs_to_proto(gen.prompt_logprobs))
                            sent_prompt = True
                        yield event
                except APIError as e:
                    await _abort(context, e)
            finally:
                self._ctx.in_flight.release()
                if tenant is not None and gate is not None:
                    gate.leave(tenant)

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: client_pb2.ClientAbortRequest, context: grpc.aio.ServicerContext
    ) -> client_pb2.ClientAbortReply:
        tenant = None
        try:
            tenant = self._authorize(context)
        except APIError as e:
            await _abort(context, e)
        # With tenants, a caller ends only its own tenant's requests.
        found = self._ctx.active.abort(request.request_id,
                                       tenant=tenant.name if tenant is not None else None)
        return client_pb2.ClientAbortReply(found=found)

    def _authorize(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """The caller's tenant (with a tenants file), else None; raises the 401."""
        given = _metadata(context, "authorization")
        header = given.encode("latin-1", "replace") if given else None
        if self._ctx.tenants is not None:
            return self._ctx.tenants.identify(header)
        key = self._ctx.settings.api_key
        if key:
            error = check_api_key(header, key.encode())
            if error is not None:
                raise error
        return None

    async def _prepare(self, request: client_pb2.ClientGenerateRequest, request_id: str,
                       tenant: Tenant | None) -> Generation:
        if not valid_request_id(request_id):
            raise invalid("request_id must be 1-128 characters of A-Z a-z 0-9 . _ -", "request_id")
        model = await self._ctx.backend.model()
        req = await conversion.from_client(request, model)
        return self._ctx.generation(model, req, request_id=request_id, arrival=None,
                                    tenant=tenant)


def _metadata_request_id(context: grpc.aio.ServicerContext) -> str | None:
    return _metadata(context, "x-request-id")


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name and isinstance(value, str):
            return value
    return None


async def _abort(context: grpc.aio.ServicerContext, error: APIError) -> None:
    """End the call with the error's status; a 429/503 carries gRPC's retry pushback."""
    await context.abort(error.grpc_code, error.message, trailing_metadata=error.grpc_trailers)


async def start_server(ctx: GatewayContext, host: str, port: int) -> grpc.aio.Server:
    """Serve SuperInfer and the standard health service on ``host:port``."""
    # No SO_REUSEPORT: a second gateway on a busy port must fail, not share it. A message
    # over --max-body-bytes is refused by gRPC itself (RESOURCE_EXHAUSTED), like a REST body.
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", ctx.settings.max_body_bytes),
    ])
    client_pb2_grpc.add_SuperInferServicer_to_server(SuperInferServicer(ctx), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address} for the client gRPC API (port in use?)")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("superinfer.SuperInfer", health_pb2.HealthCheckResponse.SERVING)
    log.info("client gRPC API listening", address=address)
    return server
