"""The gateway's one token stream from the scheduler, split into per-request queues.

One `Subscribe` call carries the events of every request this gateway submitted, one
`TokenBatch` per scheduler iteration (scheduler_svc/token_stream.py); a reader task puts
each event into its request's queue, found by the stream number the gateway gave at
`Submit` (a request id may be reused once its request ended, and the old request's last
events may still be on their way). When the call ends — the scheduler died, restarted or
shut down — every open request gets the error, and the next request opens a new call.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import grpc
import structlog

from gateway.errors import APIError, from_grpc, unavailable
from proto import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger()

# What a request's queue yields: its events in order; an APIError when the stream broke;
# None when the gateway itself ended the request (an abort), to wake its reader.
Item = scheduler_pb2.TokenEvent | APIError | None


class TokenStream:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.subscriber_id = f"gw-{uuid.uuid4().hex}"
        self._stub = stub
        self._call: grpc.aio.UnaryStreamCall[scheduler_pb2.SubscribeRequest,
                                             scheduler_pb2.TokenBatch] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[int, asyncio.Queue[Item]] = {}
        self._numbers = itertools.count(1)
        self.error: APIError | None = None  # set once the call has ended

    @property
    def live(self) -> bool:
        return self._reader is not None and self.error is None

    async def open(self, timeout_s: float) -> None:
        """Subscribe and wait for the scheduler's first (empty) batch: from then on, Submit
        may name this subscription. Raises APIError if the scheduler does not answer."""
        call = self._stub.Subscribe(scheduler_pb2.SubscribeRequest(subscriber_id=self.subscriber_id))
        self._call = call
        try:
            first = await asyncio.wait_for(call.read(), timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        except TimeoutError:
            call.cancel()
            raise unavailable("the scheduler did not open the token stream in time") from None
        if first is grpc.aio.EOF:
            raise unavailable("the scheduler closed the token stream at once")
        self._reader = asyncio.get_running_loop().create_task(self._read(call))
        log.info("token stream open", subscriber_id=self.subscriber_id)

    def register(self) -> tuple[int, asyncio.Queue[Item]]:
        """A new stream number and the queue its events will land in."""
        number = next(self._numbers)
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[number] = queue
        return number, queue

    def unregister(self, number: int) -> None:
        self._queues.pop(number, None)

    async def _read(self, call: grpc.aio.UnaryStreamCall[scheduler_pb2.SubscribeRequest,
                                                         scheduler_pb2.TokenBatch]) -> None:
        error = unavailable("the token stream from the scheduler failed")
        try:
            # read(), not `async for`: the first message was taken with read(), and gRPC
            # does not let the two mix.
            while (batch := await call.read()) is not grpc.aio.EOF:
                queues = self._queues
                for ev in batch.events:
                    queue = queues.get(ev.stream)
                    if queue is not None:  # else: its request has ended here already
                        queue.put_nowait(ev)
            error = unavailable("the scheduler closed the token stream (shutting down)")
        except grpc.aio.AioRpcError as e:
            error = from_grpc(e)
        except asyncio.CancelledError:
            error = unavailable("the gateway is shutting down")
            raise
        finally:
            self.error = error
            for queue in self._queues.values():
                queue.put_nowait(self.error)
            self._queues.clear()
            log.warning("token stream ended", subscriber_id=self.subscriber_id,
                        error=self.error.message)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
