"""One request's life in the gateway: submit, stream, detokenize, stop, clean up.

The scheduler streams token ids; this turns them into text deltas (with stop strings
held back by ``OutputTracker``), records latency metrics, and guarantees that a request
which ends early for any reason — stop string, client gone, error, external abort —
is aborted at the scheduler so its KV blocks are freed at once. Cleanup runs in
``finally`` and never awaits: it must also work inside a cancelled task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
import structlog

from common.output import OutputTracker
from gateway.backend import ModelState, SchedulerBackend
from gateway.errors import APIError, from_grpc
from gateway.metrics import GatewayMetrics
from proto import scheduler_pb2

# A lazy proxy, not get_logger(): a logger bound at import time would keep the default
# configuration instead of the one configure_logging() installs later.
log = structlog.get_logger()


@dataclass(slots=True)
class Delta:
    """New output since the last delta; ``finish_reason`` is set on the last one."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class ActiveRequests:
    """Requests in flight, by id: rejects duplicate ids and serves client-side aborts."""

    def __init__(self) -> None:
        self._by_id: dict[str, Generation] = {}

    def add(self, gen: Generation) -> None:
        if gen.request_id in self._by_id:
            raise APIError(
                409, f"request id {gen.request_id!r} is already in flight; use a unique X-Request-ID",
                param="X-Request-ID", code="duplicate_request_id",
            )
        self._by_id[gen.request_id] = gen

    def remove(self, gen: Generation) -> None:
        if self._by_id.get(gen.request_id) is gen:
            del self._by_id[gen.request_id]

    def abort(self, request_id: str) -> bool:
        gen = self._by_id.get(request_id)
        if gen is None:
            return False
        gen.abort()
        return True

    def __len__(self) -> int:
        return len(self._by_id)


class Generation:
    def __init__(
        self,
        *,
        backend: SchedulerBackend,
        metrics: GatewayMetrics,
        active: ActiveRequests,
        model: ModelState,
        request: scheduler_pb2.GenerateRequest,
        stop: tuple[str, ...] = (),
        arrival: float | None = None,
    ) -> None:
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (final event)
        self.finish_reason: str | None = None
        self._backend = backend
        self._metrics = metrics
        self._active = active
        self._request = request
        self._tracker = OutputTracker(model.tokenizer, stop)
        self._arrival = time.monotonic() if arrival is None else arrival
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._call: grpc.aio.UnaryStreamCall[scheduler_pb2.GenerateRequest, scheduler_pb2.TokenEvent] | None = None
        self._aborted = False
        self._started = False
        self._scheduler_done = False  # the scheduler finished it, or was told to

    @property
    def text(self) -> str:
        return self._tracker.text

    def abort(self) -> None:
        """Abort on the client's behalf; the stream then ends with finish_reason "abort"."""
        self._aborted = True
        if self._call is not None:
            self._call.cancel()

    async def stream(self) -> AsyncGenerator[Delta, None]:
        """Deltas until the request finishes; scheduler errors raise ``APIError``."""
        if self._started:
            raise RuntimeError("a Generation streams once")
        self._started = True
        outcome = "abort"
        try:
            self._active.add(self)
            self._call = self._backend.generate(self._request)
            log.info("request submitted", request_id=self.request_id,
                     prompt_tokens=self.prompt_tokens, max_tokens=self._request.sampling.max_tokens)
            try:
                async for event in self._call:
                    delta = self._on_event(event)
                    if delta.finish_reason is not None:
                        outcome = self.finish_reason = delta.finish_reason
                    if delta.text or delta.token_ids or delta.finish_reason:
                        yield delta
                    if self.finish_reason is not None:
                        return
            except grpc.aio.AioRpcError as e:
                if not self._aborted:
                    raise from_grpc(e) from None
            except asyncio.CancelledError:
                # Our own abort() cancels the call; a cancelled task must still unwind.
                if not self._aborted or _task_is_cancelled():
                    raise
            if self._aborted:
                outcome = self.finish_reason = "abort"
                yield Delta(self._tracker.finish(), finish_reason="abort")
                return
            raise APIError(502, "the scheduler closed the stream before the request finished",
                           code="scheduler_stream_ended")
        except APIError as e:
            outcome = "rejected" if e.status < 500 else "error"
            raise
        finally:
            self._cleanup(outcome)

    def _on_event(self, event: scheduler_pb2.TokenEvent) -> Delta:
        ids = list(event.token_ids)
        if ids:
            self._record_tokens(len(ids))
        if event.finish_reason:
            self._scheduler_done = True
            self.cached_tokens = event.cached_tokens
        if event.finish_reason == "error":
            raise APIError(500, "the engine failed while generating this request",
                           code="generation_failed")
        final = bool(event.finish_reason)
        text = self._tracker.feed(ids, final=final)
        if final:
            return Delta(text, ids, event.finish_reason)
        if self._tracker.stopped:
            # A stop string matched in the text, which only the gateway sees: finish like
            # EOS, and tell the scheduler to free the request without making the client
            # wait for that round trip.
            self._scheduler_done = True
            self._backend.abort_soon(self.request_id, "stop")
            return Delta(text, ids, "stop")
        return Delta(text, ids)

    def _record_tokens(self, n: int) -> None:
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self._arrival)
            self._metrics.prompt_tokens.inc(self.prompt_tokens)
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self._last_token_at) / n
        for _ in range(n_gaps):
            self._metrics.itl.observe(gap)
        self._last_token_at = now
        self.completion_tokens += n
        self._metrics.generation_tokens.inc(n)

    def _cleanup(self, outcome: str) -> None:
        if self._call is not None:
            self._call.cancel()  # no-op once the stream has ended
        if not self._scheduler_done and self._call is not None:
            # Client gone, external abort, error or cancellation mid-stream: free the
            # blocks now. The stop-string path already sent its own Abort(reason="stop").
            self._backend.abort_soon(self.request_id, "abort")
        self._active.remove(self)
        self._metrics.requests.labels(outcome).inc()
        e2e = time.monotonic() - self._arrival
        if self.finish_reason is not None:
            self._metrics.e2e.observe(e2e)
        log.info("request finished", request_id=self.request_id, outcome=outcome,
                 prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                 ttft_s=None if self._first_token_at is None else round(self._first_token_at - self._arrival, 4),
                 e2e_s=round(e2e, 4))


def _task_is_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
