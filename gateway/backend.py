"""The gateway's only link to the engine: a gRPC client of the scheduler.

Every call carries a deadline and the request id as ``x-request-id`` metadata, so the
scheduler's log lines can be matched to the gateway's. Tokens come back on one stream for
all requests (gateway/token_stream.py); a request's own deadline (``generate_timeout_s``,
only when configured: a long generation is legitimate) is kept by `Generation`. The model's facts (context
length, tokenizer source) are fetched once and cached; until the scheduler has answered,
requests get a 503 rather than waiting.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from common.errors import SuperInferError
from common.generation_defaults import GenerationDefaults
from common.generation_defaults import resolve as resolve_defaults
from common.modelfile import ModelKind, ModelSource
from common.tokenizer import Tokenizer
from gateway.errors import APIError, from_grpc, unavailable
from gateway.token_stream import Item, TokenStream
from proto import scheduler_pb2, scheduler_pb2_grpc

# A lazy proxy, not get_logger(): a logger bound at import time would keep the default
# configuration instead of the one configure_logging() installs later.
log = structlog.get_logger()

# Reconnect quickly after a scheduler restart: gRPC's default backoff grows to 120 s,
# which would keep answering 503 long after the scheduler is back.
_CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),  # loopback: never through a proxy from the environment
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request the scheduler admitted: where its events land."""

    stream: TokenStream
    number: int
    queue: asyncio.Queue[Item]

    def release(self) -> None:
        """The request has ended here: its later events (if any) are dropped."""
        self.stream.unregister(self.number)


@dataclass(frozen=True, slots=True)
class ModelState:
    """What the gateway needs to know about the served model."""

    info: scheduler_pb2.ModelInfo
    tokenizer: Tokenizer
    served_name: str
    max_model_len: int
    vocab_size: int
    defaults: GenerationDefaults = GenerationDefaults()  # for the fields a request leaves unset


class SchedulerBackend:
    def __init__(
        self,
        address: str,
        *,
        served_model_name: str | None = None,
        rpc_timeout_s: float = 5.0,
        generate_timeout_s: float | None = None,
        generation_config: str = "auto",
    ) -> None:
        self.address = address
        self.generation_config = generation_config
        self.served_model_name = served_model_name
        self.rpc_timeout_s = rpc_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._model: ModelState | None = None
        self._model_lock = asyncio.Lock()
        # Fire-and-forget aborts must outlive a cancelled request task; keeping a
        # reference stops them being garbage-collected mid-flight.
        self._background: set[asyncio.Task[bool]] = set()
        self._stream: TokenStream | None = None  # every request's events (token_stream.py)
        self._stream_lock = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Open the channel; it must be created inside the serving event loop."""
        self._channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self._background:
            await asyncio.wait(self._background, timeout=self.rpc_timeout_s)
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            raise unavailable("the gateway is starting")
        return self._stub

    # -- model -------------------------------------------------------------------------
    async def model(self) -> ModelState:
        """The served model; the first call asks the scheduler and loads the tokenizer."""
        if self._model is not None:
            return self._model
        async with self._model_lock:
            if self._model is None:
                info = await self.model_info()
                tokenizer, defaults = await asyncio.to_thread(
                    _load_model_files, info, self.generation_config)
                self._model = ModelState(
                    info=info,
                    tokenizer=tokenizer,
                    served_name=self.served_model_name or info.name,
                    max_model_len=info.max_model_len,
                    vocab_size=info.vocab_size or tokenizer.vocab_size,
                    defaults=defaults,
                )
                log.info("model ready", model=self._model.served_name,
                         max_model_len=info.max_model_len, source=info.source_path,
                         generation_defaults=defaults.as_dict())
        return self._model

    @property
    def served_name(self) -> str | None:
        """The model's name for clients, once known: --served-model-name, else the
        scheduler's answer (None until the first one)."""
        if self._model is not None:
            return self._model.served_name
        return self.served_model_name

    async def warm_up(self, retry_s: float = 0.5) -> None:
        """Retry ``model()`` until the scheduler answers, so the first request is fast."""
        while self._model is None:
            try:
                await self.model()
            except APIError as e:
                if e.status != 503:
                    log.error("model setup failed", error=e.message)
                    return
                await asyncio.sleep(retry_s)

    async def model_info(self) -> scheduler_pb2.ModelInfo:
        try:
            info: scheduler_pb2.ModelInfo = await self.stub.GetModelInfo(
                scheduler_pb2.ModelInfoRequest(), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return info

    async def stats(self) -> scheduler_pb2.StatsReply:
        try:
            reply: scheduler_pb2.StatsReply = await self.stub.GetStats(
                scheduler_pb2.StatsRequest(), timeout=self.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return reply

    # -- requests ----------------------------------------------------------------------
    async def submit(self, request: scheduler_pb2.GenerateRequest) -> Submitted:
        """Admit a request at the scheduler; its events arrive in the returned queue.
        Refusals raise ``APIError`` (see ``from_grpc``); a broken stream later arrives in
        the queue as one."""
        for attempt in (1, 2):
            stream = await self._token_stream()
            number, queue = stream.register()
            try:
                await self.stub.Submit(
                    scheduler_pb2.SubmitRequest(request=request, subscriber_id=stream.subscriber_id,
                                                stream=number),
                    timeout=self.rpc_timeout_s,
                    metadata=(("x-request-id", request.request_id),),
                )
            except grpc.aio.AioRpcError as e:
                stream.unregister(number)
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and attempt == 1:
                    # The scheduler restarted since the stream was opened: open a new one.
                    await stream.close()
                    continue
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    self.abort_soon(request.request_id)  # it may have been admitted
                raise from_grpc(e) from None
            except asyncio.CancelledError:
                stream.unregister(number)
                self.abort_soon(request.request_id)
                raise
            return Submitted(stream, number, queue)
        raise unavailable("the scheduler keeps restarting")

    async def _token_stream(self) -> TokenStream:
        """The live subscription, opened on first use and after the last one ended."""
        if self._stream is not None and self._stream.live:
            return self._stream
        async with self._stream_lock:
            if self._stream is None or not self._stream.live:
                if self._stream is not None:
                    await self._stream.close()
                    self._stream = None
                stream = TokenStream(self.stub)
                await stream.open(self.rpc_timeout_s)
                self._stream = stream
        return self._stream

    async def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Tell the scheduler to finish a request and free its blocks; False if unknown."""
        try:
            reply = await self.stub.Abort(
                scheduler_pb2.AbortRequest(request_id=request_id, reason=reason),
                timeout=self.rpc_timeout_s,
                metadata=(("x-request-id", request_id),),
            )
        except (grpc.aio.AioRpcError, APIError) as e:
            # The stream is being torn down anyway; a scheduler that is gone holds no blocks.
            log.warning("abort failed", request_id=request_id, reason=reason, error=str(e))
            return False
        return bool(reply.found)

    def abort_soon(self, request_id: str, reason: str = "abort") -> None:
        """Abort from a context that may be cancelled (a disconnected client's task)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _load_model_files(info: scheduler_pb2.ModelInfo,
                     generation_config: str) -> tuple[Tokenizer, GenerationDefaults]:
    if info.source_kind not in ("gguf", "hf") or not info.source_path:
        raise APIError(
            500,
            f"the scheduler reported an unusable model source ({info.source_kind!r}, "
            f"{info.source_path!r})",
            code="model_source_invalid",
        )
    kind: ModelKind = "gguf" if info.source_kind == "gguf" else "hf"
    source = ModelSource(kind=kind, path=Path(info.source_path), name=info.name)
    try:
        return Tokenizer.from_source(source), resolve_defaults(generation_config, source)
    except SuperInferError as e:
        raise APIError(500, f"cannot load the model's files: {e.message}", code=e.code) from e
