"""One request's life in the gateway: submit, stream, detokenize, stop, clean up.

The scheduler streams token ids (on the gateway's one token stream, which puts them in
this request's queue); this turns them into text deltas (with stop strings
held back by ``OutputTracker``), records latency metrics, and guarantees that a request
which ends early for any reason — stop string, client gone, error, external abort —
is aborted at the scheduler so its KV blocks are freed at once. Cleanup runs in
``finally`` and never awaits: it must also work inside a cancelled task.

A request with n > 1 choices is one stream whose events name their choice (`index`);
each choice has its own text, stop strings (a match stops that choice alone, by its
scheduler id "<id>#<index>"), tokens and logprobs. Echo's prompt logprobs arrive once,
before the first token of choice 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc
import structlog

from common.contracts import TokenLogprob
from common.output import OutputTracker
from common.wire import logprob_from_proto
from gateway.backend import ModelState, SchedulerBackend, Submitted
from gateway.errors import APIError, from_status
from gateway.metrics import GatewayMetrics
from gateway.token_stream import Item
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
    index: int = 0  # which choice
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for


@dataclass(slots=True)
class Choice:
    """One choice's output so far."""

    tracker: OutputTracker
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self.tracker.text


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

    def abort(self, request_id: str, tenant: str | None = None) -> bool:
        """Abort the request `request_id` (of `tenant` only, where given)."""
        gen = self._by_id.get(request_id)
        if gen is None or (tenant is not None and gen.tenant != tenant):
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
        on_finish: Callable[[int], None] | None = None,
    ) -> None:
        """`on_finish(completion_tokens)`: called once when the request ends, however."""
        self.request_id = request.request_id
        self.tenant = request.tenant  # "" without a tenants file: no tenant label
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (final event)
        self.finish_reason: str | None = None  # set once every choice has finished
        self.choices = [Choice(OutputTracker(model.tokenizer, stop))
                        for _ in range(max(1, request.n))]
        self.prompt_logprobs: list[TokenLogprob] = []  # echo: prompt tokens 1, 2, ...
        self._open = len(self.choices)
        self._backend = backend
        self._metrics = metrics
        self._active = active
        self._request = request
        self._arrival = time.monotonic() if arrival is None else arrival
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._submitted: Submitted | None = None
        self._aborted = False
        self._started = False
        self._scheduler_done = False  # the scheduler finished it, or was told to
        self._on_finish = on_finish

    @property
    def text(self) -> str:
        return self.choices[0].text

    def _choice_id(self, index: int) -> str:
        """The scheduler's id of one choice (scheduler_svc/fork.py child_id)."""
        return self.request_id if len(self.choices) == 1 else f"{self.request_id}#{index}"

    def abort(self) -> None:
        """Abort on the client's behalf; the stream then ends with finish_reason "abort"."""
        self._aborted = True
        if self._submitted is not None:
            self._submitted.queue.put_nowait(None)  # wake the stream

    async def stream(self) -> AsyncGenerator[Delta, None]:
        """Deltas until the request finishes; scheduler errors raise ``APIError``."""
        if self._started:
            raise RuntimeError("a Generation streams once")
        self._started = True
        outcome = "abort"
        try:
            self._active.add(self)
            self._submitted = await self._backend.submit(self._request)
            log.info("request submitted", request_id=self.request_id,
                     prompt_tokens=self.prompt_tokens, max_tokens=self._request.sampling.max_tokens)
            queue = self._submitted.queue
            timeout = self._backend.generate_timeout_s
            deadline = None if timeout is None else self._arrival + timeout
            while not self._aborted:
                if deadline is None:
                    event = await queue.get()
                else:
                    event = await _get_until(queue, deadline)
                if event is None:
                    continue  # abort() woke us
                if isinstance(event, APIError):  # the token stream broke
                    raise event
                delta = self._on_event(event)
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    self._open -= 1
                    if not self._open:
                        outcome = self.finish_reason = delta.finish_reason
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield delta
                if self.finish_reason is not None:
                    return
            outcome = self.finish_reason = "abort"
            for i, choice in enumerate(self.choices):
                if choice.finish_reason is None:
                    choice.finish_reason = "abort"
                    yield Delta(choice.tracker.finish(), finish_reason="abort", index=i)
        except APIError as e:
            outcome = "rejected" if e.status < 500 else "error"
            raise
        finally:
            self._cleanup(outcome)

    def _on_event(self, event: scheduler_pb2.TokenEvent) -> Delta | None:
        if event.error:  # the scheduler could not serve it (recovery impossible, shutdown)
            self._scheduler_done = True
            raise from_status(grpc.StatusCode.UNAVAILABLE, event.error)
        if event.prompt_logprobs:
            self.prompt_logprobs.extend(logprob_from_proto(m) for m in event.prompt_logprobs)
        index = event.index
        if not 0 <= index < len(self.choices):
            raise APIError(502, f"the scheduler sent choice {index} of {len(self.choices)}",
                           code="scheduler_stream_invalid")
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return None  # stopped here already (a stop string); the scheduler's last word
        ids = list(event.token_ids)
        final = bool(event.finish_reason)
        text = choice.tracker.feed(ids, final=final)
        lps = [logprob_from_proto(m) for m in event.logprobs]
        if choice.tracker.last_used < len(ids):
            # A stop string ended inside a speculative run: the tokens after it are no
            # part of the output (nor of the usage).
            ids, lps = ids[: choice.tracker.last_used], lps[: choice.tracker.last_used]
        if ids:
            self._record_tokens(len(ids))
        if event.finish_reason:
            self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        if event.finish_reason == "error":
            self._scheduler_done = True
            raise APIError(500, "the engine failed while generating this request",
                           code="generation_failed")
        choice.token_ids.extend(ids)
        choice.logprobs.extend(lps)
        if final:
            choice.finish_reason = event.finish_reason
            if self._open == 1:
                self._scheduler_done = True
            return Delta(text, ids, event.finish_reason, index, lps)
        if choice.tracker.stopped:
            # A stop string matched in the text, which only the gateway sees: finish like
            # EOS, and tell the scheduler to free the choice without making the client
            # wait for that round trip.
            choice.finish_reason = "stop"
            if self._open == 1:
                self._scheduler_done = True
            self._backend.abort_soon(self._choice_id(index), "stop")
            return Delta(text, ids, "stop", index, lps)
        return Delta(text, ids, None, index, lps)

    def _record_tokens(self, n: int) -> None:
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self._arrival)
            self._metrics.prompt_tokens.inc(self.prompt_tokens, self.tenant)
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - self._last_token_at) / n
        for _ in range(n_gaps):
            self._metrics.itl.observe(gap)
        self._last_token_at = now
        self.completion_tokens += n
        self._metrics.generation_tokens.inc(n, self.tenant)

    def _cleanup(self, outcome: str) -> None:
        if self._submitted is not None:
            self._submitted.release()
            if not self._scheduler_done:
                # Client gone, external abort, error or cancellation mid-stream: free the
                # blocks now. The stop-string path already sent its own Abort(reason="stop").
                self._backend.abort_soon(self.request_id, "abort")
        self._active.remove(self)
        if self._on_finish is not None:
            self._on_finish(self.completion_tokens)
        self._metrics.requests.labels(outcome).inc()
        e2e = time.monotonic() - self._arrival
        if self.finish_reason is not None:
            self._metrics.e2e.observe(e2e)
        log.info("request finished", request_id=self.request_id, outcome=outcome,
                 **({"tenant": self.tenant} if self.tenant else {}),
                 prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                 ttft_s=None if self._first_token_at is None else round(self._first_token_at - self._arrival, 4),
                 e2e_s=round(e2e, 4))


async def _get_until(queue: asyncio.Queue[Item], deadline: float) -> Item:
    """The next item, or the gateway's --request-timeout as the scheduler's deadline
    status would have said it."""
    try:
        return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
