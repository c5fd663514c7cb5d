"""Stream events as proto messages, and the gateway's subscription (`Subscribe` / `Submit`).

A `Generate` call streams one `TokenEvent` per request per token: with 32 streams, 32
messages (and 32 handler wake-ups on each side) per iteration. A subscription carries
every request that one gateway submitted, and each publish of the serving loop (an
iteration's output, an abort) becomes a single `TokenBatch` on it: one message and one
wake-up per iteration, whatever the number of streams. On a 2-core machine, the CPU that
per-request messages burn in the scheduler and the gateway is taken from the worker's
forward (docs/results/pipeline/).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from common.wire import logprobs_to_proto
from proto import scheduler_pb2
from scheduler_svc.loop import StreamEvent


def token_event_fields(stream_id: str, prompt_tokens: int, ev: StreamEvent) -> dict[str, Any]:
    """A `TokenEvent`'s fields for one stream event (without `error`, which a Generate
    call turns into its status instead)."""
    return {
        "request_id": stream_id,
        "token_ids": ev.token_ids,
        "finish_reason": ev.finish_reason or "",
        "prompt_tokens": prompt_tokens,
        "output_tokens": ev.output_tokens,
        "summary_json": json.dumps(ev.summary) if ev.summary is not None else "",
        "index": ev.index,
        "logprobs": logprobs_to_proto(ev.logprobs or ()),
        "prompt_logprobs": logprobs_to_proto(ev.prompt_logprobs or ()),
        "cached_tokens": ev.cached_tokens,
    }


class Subscription:
    """One gateway's token stream: a StreamSink that batches each publish into one message.

    `live` names the streams still open on it (request id -> [the submitter's stream
    number, prompt tokens, open choices]); when the subscription ends, the service aborts
    them.
    """

    def __init__(self, subscriber_id: str) -> None:
        self.subscriber_id = subscriber_id
        self.live: dict[str, list[int]] = {}
        # None: the service closed the subscription (shutting down); the stream ends.
        self.queue: asyncio.Queue[scheduler_pb2.TokenBatch | None] = asyncio.Queue()
        self._batch: scheduler_pb2.TokenBatch | None = None

    def add(self, stream_id: str, stream: int, prompt_tokens: int, choices: int) -> None:
        self.live[stream_id] = [stream, prompt_tokens, choices]

    def deliver(self, stream_id: str, event: StreamEvent) -> None:
        state = self.live.get(stream_id)
        if state is None:
            return  # not ours any more (cannot happen: the loop routes by request)
        if self._batch is None:
            self._batch = scheduler_pb2.TokenBatch()
        msg = self._batch.events.add(**token_event_fields(stream_id, state[1], event),
                                     stream=state[0])
        if event.finish_reason:
            if event.error is not None:
                msg.error = event.error
            state[2] -= 1
            if not state[2]:
                del self.live[stream_id]

    def flush(self) -> None:
        if self._batch is not None:
            self.queue.put_nowait(self._batch)
            self._batch = None

    def close(self) -> None:
        self.flush()
        self.queue.put_nowait(None)
