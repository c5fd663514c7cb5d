"""The scheduler's KV events on the wire, as vLLM publishes them (`--kv-events-config`).

The block manager reports to an `EventBuffer` (scheduler_svc/kv_events.py); this module
sends what it collected over ZMQ in vLLM's format, which vllm-router 0.1.17 was read and
tested against (tests/test_router.py runs the real one):

* PUB socket at `endpoint`: one message per batch, three frames `[topic, seq, payload]` —
  seq an 8-byte big-endian signed integer, 0 for a publisher's first batch and one more per
  batch; payload `msgpack([timestamp, events, data_parallel_rank])` with rank nil, each
  event a map tagged by `type` (vLLM's 2026 encoding; positional arrays are rejected).
* ROUTER socket at `replay_endpoint`: a subscriber that missed batches sends
  `[b"", start_seq (8 bytes)]` and gets every buffered batch from that seq as
  `[b"", topic, seq, payload]`, then `[b"", b"", -1, b""]`.

The first batch a publisher sends is `AllBlocksCleared`: a scheduler that (re)starts has
no cached block, and a router must drop what it believed of the last one. A batch is sent
a few milliseconds after the first event that follows the last one, so an iteration's
changes go in one batch. When nothing happened for a second the latest batch is sent
again, same seq: a subscriber that has it skips it, one that joined late or missed the
first batch of a new process sees its gap (or the restart) now and replays, instead of
believing stale blocks until the next change.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

import msgpack
import structlog
import zmq
import zmq.asyncio

from common.kv_events import Endpoint, KVEventsConfig
from scheduler_svc.kv_events import Event, EventBuffer

log = structlog.get_logger()

MAX_EVENTS_PER_BATCH = 4096  # vllm-router refuses a longer events list
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsBindError(RuntimeError):
    """A socket of --kv-events-config could not be bound; the message names it."""


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events, None], use_bin_type=True)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


class KVEventPublisher(EventBuffer):
    """An `EventBuffer` whose events go out on ZMQ, with a replay buffer."""

    def __init__(self, config: KVEventsConfig, block_size: int = 16,
                 flush_delay_s: float = 0.005, resend_idle_s: float = 1.0) -> None:
        super().__init__(block_size)
        self.config = config
        self.topic = config.topic.encode()
        self.flush_delay_s = flush_delay_s
        self.resend_idle_s = resend_idle_s
        self.next_seq = 0
        self.batches_sent = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # -- the sink: wake the sender on the first event of a batch ----------------------------
    def stored(self, hashes: Sequence[bytes], parent: bytes | None,
               token_ids: Sequence[int], medium: str) -> None:
        super().stored(hashes, parent, token_ids, medium)
        self._wake.set()

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        super().removed(hashes, medium)
        self._wake.set()

    def cleared(self) -> None:
        super().cleared()
        self._wake.set()

    # -- sockets ------------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind both sockets (KVEventsBindError names the one that failed) and queue the
        first batch, AllBlocksCleared. Call inside the event loop that will serve them."""
        ctx = self._ctx = zmq.asyncio.Context()
        self._pub = self._bound(ctx, zmq.PUB, "endpoint", self.config.endpoint)
        self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        if self.config.replay_endpoint is not None:
            self._replay = self._bound(ctx, zmq.ROUTER, "replay_endpoint",
                                       self.config.replay_endpoint)
        self.cleared()

    def _bound(self, ctx: zmq.asyncio.Context, kind: int, field: str,
               endpoint: Endpoint) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint.text)
        except zmq.ZMQError as e:
            sock.close()
            self.close_sockets()
            raise KVEventsBindError(
                f"cannot bind the KV events {field} {endpoint.text} "
                f"(port {endpoint.port}): {e.strerror}") from None
        return sock

    def start(self) -> None:
        """Start sending (and answering replays); after bind()."""
        self._tasks = [asyncio.create_task(self._send_loop(), name="kv-events")]
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))
        log.info("kv_events_publishing", endpoint=self.config.endpoint.text,
                 replay_endpoint=(self.config.replay_endpoint.text
                                  if self.config.replay_endpoint else None),
                 topic=self.config.topic, block_size=self.block_size)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.flush()  # what the last iteration changed
        self.close_sockets()

    def close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- sending --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send what is pending, in batches of at most MAX_EVENTS_PER_BATCH events."""
        events = self.take()
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self.publish(events[i:i + MAX_EVENTS_PER_BATCH])

    def publish(self, events: list[Event]) -> int:
        """One batch on the PUB socket (never blocks: past the high-water mark ZMQ drops
        it, and the subscriber replays the gap); its seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(events)
        self._buffer.append((seq, payload))
        self._send(seq, payload)
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send_multipart([self.topic, _seq(seq), payload], flags=zmq.NOBLOCK)
            self.batches_sent += 1
        except zmq.Again:
            log.warning("kv_events_dropped", seq=seq)

    async def _send_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.resend_idle_s)
            except TimeoutError:
                if self._buffer:  # idle: the latest batch again (see the module's top)
                    self._send(*self._buffer[-1])
                continue
            await asyncio.sleep(self.flush_delay_s)
            self._wake.clear()
            self.flush()

    async def _replay_loop(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            batches = [(s, p) for s, p in self._buffer if s >= start]
            for s, p in batches:
                await sock.send_multipart([ident, b"", self.topic, _seq(s), p])
            await sock.send_multipart([ident, b"", b"", END_SEQ, b""])
            log.info("kv_events_replayed", start_seq=start, batches=len(batches))
