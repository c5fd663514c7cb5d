"""The scheduler service's serving loop: the engine step over gRPC, streams, recovery.

The same engine step as `superinfer generate` (`scheduler_svc/engine_core.py`), with
kvmem as its transfer engine and the worker as its executor (the lanes at the end of this
file). What the loop adds is the service's own: each live request's events go to a `StreamSink`
— its own `EventQueue` that a `Generate` stream drains, or a subscription that carries
every request of a gateway, one message per publish (`scheduler_svc/token_stream.py`);
everything here runs on the event loop's thread, so scheduler state needs no lock —
handlers and the loop take turns at `await` points.

When an iteration fails (a peer died, restarted, or missed its deadline) no request is
lost (DESIGN §6): the loop waits for both peers to serve again, re-attaches kvmem to the
worker's pool, asks each for the identity of its pool, and tells the scheduler core what
was lost — the device pool (new worker), the host pool (new kvmem), or only the failed
batch's copies. Requests then resume by swap-in of their host copies or by recompute;
their streams just see a pause. Iterations are idempotent (a chunk writes the same KV at
the same positions, and sampling is seeded per step), so re-running one is safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import grpc
import structlog

from common.contracts import (
    ExecuteResult,
    ScheduledChunk,
    TokenLogprob,
    TransferPlan,
    TransferResult,
)
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.interfaces import SchedulerInterface
from scheduler_svc.remote import RemoteKVMem, RemoteWorker
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.scheduler import RequestEvent
from scheduler_svc.scheduler_config import tenant_key
from scheduler_svc.setup import model_identity
from scheduler_svc.slo_attribution import MissHistograms
from scheduler_svc.trace import Trace

log = structlog.get_logger()

IDLE_POLL_S = 0.002  # an iteration that scheduled nothing (all blocked) waits this long
RETRY_S = 0.2  # after a failed iteration, before looking at the peers again
MAX_FAILED_ATTEMPTS = 5  # failed iterations in a row with healthy peers: a bug, not an outage


class BackendMismatch(RuntimeError):
    """The worker or kvmem came back with pools the scheduler was not built for."""


@dataclass(slots=True)
class StreamEvent:
    """What one Generate stream receives: new tokens, and on the last event why it ended."""

    token_ids: list[int]
    output_tokens: int
    finish_reason: str | None = None
    summary: dict[str, object] | None = None
    error: str | None = None  # the request could not be served: why, and what to do
    index: int = 0  # which choice of a request with n > 1
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # echo: the next prompt tokens'
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (final event)


class StreamSink(Protocol):
    """Where streams' events go: `deliver` for each event of a publish, then `flush` once."""

    def deliver(self, stream_id: str, event: StreamEvent) -> None: ...

    def flush(self) -> None: ...


class EventQueue(asyncio.Queue[StreamEvent]):
    """One stream's events, in order: the sink of a single `Generate` call."""

    def deliver(self, stream_id: str, event: StreamEvent) -> None:
        self.put_nowait(event)

    def flush(self) -> None:
        pass


@dataclass(slots=True)
class _Route:
    sink: StreamSink
    stream_id: str  # what the client submitted: the request's id, or its group's (n > 1)
    index: int = 0  # which choice


# GetStats' key of the blame seconds: `slo_miss_blame_s:<holder>[@<tenant>]`.
BLAME_KEY = "slo_miss_blame_s"


@dataclass(slots=True)
class SLOCounts:
    """One tenant's SLO attainment (DESIGN 8) and goodput, on the scheduler's clock."""

    slo_ttft_met: int = 0  # finished requests whose first token came within S_B
    slo_ttft_missed: int = 0  # ... after it, or none came before S_B ran out
    slo_tbt_met: int = 0  # gaps between consecutive tokens within the request's S_F
    slo_tbt_missed: int = 0
    # Goodput, vLLM's test (bench --goodput; superinfer/slo_metrics.py meets_slo_vllm):
    # requests that ended by stop or length with TTFT <= S_B and TPOT <= S_F.
    slo_good: int = 0


@dataclass(slots=True)
class LoopStats:
    """Outages and recoveries; what the steps cost is the core's (EngineStats)."""

    backend_errors: int = 0  # failed iterations
    recoveries: int = 0  # outages recovered from without failing a request
    device_losses: int = 0  # the worker came back with a new device pool
    host_losses: int = 0  # kvmem came back with a new host pool
    resumed_swap_in: int = 0  # requests resumed from host copies after a loss
    resumed_recompute: int = 0  # requests that recompute all their tokens after a loss
    last_outage_s: float = 0.0  # failed iteration -> peers back and state repaired
    started: float = field(default_factory=time.monotonic)
    # SLO attainment against each request's own SLOs, per tenant ("" without a tenants
    # file, always exported so that its series exist from the first scrape).
    slo: dict[str, SLOCounts] = field(default_factory=lambda: {"": SLOCounts()})
    # Where the missed TTFTs and gaps spent their time (slo_attribution.py).
    slo_miss: MissHistograms = field(default_factory=MissHistograms)
    # Blame: (missed request's tenant, holder's tenant) -> seconds the missed intervals of
    # the first sat queued while the second's requests held the device (policy/shares.py).
    blame: dict[tuple[str, str], float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        d = {f.name: float(getattr(self, f.name)) for f in fields(self)
             if f.name not in ("started", "slo", "slo_miss", "blame")}
        d.update({tenant_key(f"{BLAME_KEY}:{holder}", tenant): s
                  for (tenant, holder), s in self.blame.items()})
        d["uptime_s"] = time.monotonic() - self.started
        for tenant, counts in self.slo.items():
            d.update({tenant_key(f.name, tenant): float(getattr(counts, f.name))
                      for f in fields(counts)})
        d.update(self.slo_miss.as_dict())
        return d

    def count_slo(self, req: Request, now: float, completed: bool | None = None) -> None:
        """Add a finished request to its tenant's SLO counters; `completed`: it ended by
        stop or length (None: as its finish reason says).

        A request that ended before its first token counts as a TTFT miss only once its
        budget had run out: a client that gives up after 0.1 s says nothing about S_B.
        """
        c = self.slo.get(req.tenant)
        if c is None:
            c = self.slo[req.tenant] = SLOCounts()
        missed = False
        if req.first_token_time is not None:
            if req.first_token_time - req.arrival_time <= req.slo.ttft_s:
                c.slo_ttft_met += 1
            else:
                c.slo_ttft_missed += 1
                missed = True
        elif now - req.arrival_time > req.slo.ttft_s:
            c.slo_ttft_missed += 1
            missed = True
        self.slo_miss.observe(req, missed, now)
        for holder, s in req.missed_blame.items():
            self.blame[(req.tenant, holder)] = self.blame.get((req.tenant, holder), 0.0) + s
        t = req.token_times
        gaps = sum(1 for a, b in zip(t, t[1:], strict=False) if b - a > req.slo.tbt_s)
        c.slo_tbt_missed += gaps
        c.slo_tbt_met += max(len(t) - 1, 0) - gaps
        if completed is None:
            completed = req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if completed and req.first_token_time is not None and not missed:
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
            c.slo_good += tpot <= req.slo.tbt_s


@dataclass(slots=True)
class _Outage:
    since: float  # monotonic time of the first failed iteration
    failed: list[TransferPlan]  # transfer batches whose copies may not have happened
    # Batches that read the device pool after the last batch the worker computed: if the
    # worker turns out to have restarted, they may have copied a dead pool to the host.
    unconfirmed: list[TransferPlan]
    error: str


class ServingLoop:
    def __init__(
        self,
        scheduler: SchedulerInterface,
        worker: RemoteWorker,
        kvmem: RemoteKVMem,
        pool_id: str,
        host_pool_id: str = "",
        peer_timeout_s: float = 300.0,
        trace: Trace | None = None,
        auto_xfer_budget: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.kvmem = kvmem
        self.pool_id = pool_id
        self.host_pool_id = host_pool_id
        self.peer_timeout_s = peer_timeout_s  # how long a peer may take to come back
        self.stats = LoopStats()
        self.trace = trace  # --trace: the iteration timeline (scheduler_svc/trace.py)
        self.core = EngineCore(scheduler, _WorkerLane(self), _KVMemLane(self), trace,
                               pipeline=scheduler.config.pipelined,
                               auto_xfer_budget=auto_xfer_budget)
        self.streams: dict[str, _Route] = {}  # live request id -> where its events go
        # n > 1: a request's choices are scheduler requests of their own (fork.child_id),
        # on one stream. Group id -> the choices' ids.
        self.groups: dict[str, list[str]] = {}
        self._dirty: set[StreamSink] = set()  # sinks given events since their last flush
        self.draining = False  # shutting down: no new requests
        self._work = asyncio.Event()
        self._outage: _Outage | None = None  # an iteration failed: recover before the next
        self._unconfirmed: list[TransferPlan] = []  # see _Outage.unconfirmed
        self._attempts = 0  # failed iterations since a batch last ran
        self._landed = False  # the last step's batch output landed

    # -- requests in and out (called by the gRPC handlers) ---------------------------------
    def knows(self, request_id: str) -> bool:
        return (request_id in self.scheduler.requests or request_id in self.streams
                or request_id in self.groups)

    def submit(self, req: Request, sink: StreamSink, followers: list[Request] | None = None,
               group_id: str | None = None) -> None:
        """Add a request (ValueError if the scheduler refuses it), its events to `sink`.
        With followers (n > 1), all choices share one stream under `group_id`."""
        if followers:
            choices = [req, *followers]
            self.scheduler.add_group(req, followers)
            assert group_id is not None
            self.groups[group_id] = [r.request_id for r in choices]
            for i, r in enumerate(choices):
                self.streams[r.request_id] = _Route(sink, group_id, i)
        else:
            self.scheduler.add_request(req)
            self.streams[req.request_id] = _Route(sink, req.request_id)
        log.info("submit", request_id=group_id or req.request_id,
                 prompt_tokens=req.num_prompt_tokens, n=1 + len(followers or ()),
                 max_tokens=req.sampling.max_tokens, ttft_slo=req.slo.ttft_s,
                 tbt_slo=req.slo.tbt_s)
        self._work.set()

    def _members(self, request_id: str) -> list[str]:
        return self.groups.get(request_id, [request_id])

    def finish(self, request_id: str, reason: str) -> bool:
        """Abort RPC: "stop" (a stop string matched upstream) or anything else = abort.
        A group id finishes every choice; a choice's id, that choice."""
        s = self.scheduler
        found = False
        for rid in self._members(request_id):
            found = (s.stop(rid) if reason == "stop" else s.abort(rid)) or found
        self._publish([])
        return found

    def drop(self, request_id: str) -> None:
        """The stream is gone (finished, or the client went away): free its blocks now."""
        aborted = False
        for rid in self._members(request_id):
            self.streams.pop(rid, None)
            aborted = self.scheduler.abort(rid) or aborted
        self.groups.pop(request_id, None)
        if aborted:
            self._publish([])

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.scheduler.has_unfinished() and not self.core.idle:
                # Nothing left to plan, but a batch (say, an extra token for requests that
                # just finished) or copies are still in flight: let them land, so that
                # their blocks come back.
                try:
                    self._publish(await self.core.drain())
                except Exception as e:
                    self._publish(self.core.take_landed())
                    self._on_failure(e)
                    await asyncio.sleep(RETRY_S)
                continue
            if not self.scheduler.has_unfinished():
                self._outage = None  # nothing left to resume (all finished or aborted)
                self.scheduler.abandon_in_flight()  # a failed drain: no request needs them
                if self.trace is not None:
                    self.trace.flush()  # idle: let the timeline so far reach the file
                self._work.clear()
                await self._work.wait()
                continue
            try:
                if self._outage is not None:
                    await self._recover(self._outage)
                busy = await self.step()
            except BackendMismatch as e:
                self._publish(self.core.take_landed())
                self._fail_all(str(e))
                continue
            except Exception as e:  # the loop must outlive any failed iteration
                self._publish(self.core.take_landed())  # tokens a batch gave before it failed
                self._on_failure(e)
                await asyncio.sleep(RETRY_S)
                continue
            if self._landed:
                self._attempts = 0  # a batch ran: the failures (if any) did not repeat
            if not busy:
                await asyncio.sleep(IDLE_POLL_S)

    async def drain(self, grace_s: float) -> None:
        """Shutting down: admit nothing new, let live requests finish for up to `grace_s`,
        then end the rest with a clear error."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        live = len(self.scheduler.requests)
        log.info("draining", live_requests=live, grace_s=grace_s)
        while self.scheduler.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler.has_unfinished():
            self._fail_all(f"the scheduler is shutting down and cancelled this request after "
                           f"its {grace_s:g} s grace period; retry it")
        await asyncio.sleep(0)  # let the streams take their last events

    async def step(self) -> bool:
        """One iteration; False when it had nothing to do (every request blocked)."""
        sched = self.scheduler
        res = await self.core.step()
        # A pipelined step returns before its batch ran: only a landed batch is progress.
        self._landed = res.execute is not None or not res.out.chunks
        out, plan = res.out, res.out.transfers
        self._publish(res.events)
        log.debug(
            "iteration", iteration=out.iteration, chunks=len(out.chunks),
            prefill_tokens=out.num_prefill_tokens, decode_tokens=out.num_decode_tokens,
            swap_out=len(plan.swap_out) if plan else 0, swap_in=len(plan.swap_in) if plan else 0,
            eager=len(plan.eager) if plan else 0, rotated_out=out.rotated_out,
            rotated_in=out.rotated_in, recomputed=out.recomputed, decision_s=out.decision_s,
            transfer_s=res.transfer.total_s if res.transfer else 0.0,
            execute_s=res.execute.execute_s if res.execute else 0.0,
            running=len(sched.running), waiting=len(sched.waiting), rotary=len(sched.rotary),
        )
        return res.busy

    def stats_dict(self) -> dict[str, float]:
        """The step's costs and the loop's outages, as GetStats reports them."""
        return {**self.core.stats.as_dict(), **self.stats.as_dict()}

    # -- results to streams -------------------------------------------------------------------
    def _publish(
        self, events: list[RequestEvent], reason: str | None = None, error: str | None = None
    ) -> None:
        """Send new tokens to their streams; every finished request gets its final event.

        Requests finished outside `update_from_output` (abort, stop, failure) have no
        RequestEvent; `collect_finished` is what finds them, with their summaries.
        """
        now = self.scheduler.clock()
        finished = {r.request_id: r for r in self.scheduler.collect_finished()}
        for ev in events:
            req = finished.pop(ev.request_id, None) if ev.finish_reason else None
            live = req or self.scheduler.requests.get(ev.request_id)
            n_out = live.num_output_tokens if live else 0
            if req is None:
                self._send(ev.request_id, StreamEvent(
                    ev.new_token_ids, n_out, logprobs=ev.logprobs,
                    prompt_logprobs=ev.prompt_logprobs))
            else:
                self._final(req, ev.new_token_ids, now, reason, logprobs=ev.logprobs,
                            prompt_logprobs=ev.prompt_logprobs)
        for req in finished.values():
            self._final(req, [], now, reason, error)
        for sink in self._dirty:
            sink.flush()
        self._dirty.clear()

    def _final(self, req: Request, tokens: list[int], now: float, reason: str | None,
               error: str | None = None, logprobs: list[TokenLogprob] | None = None,
               prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        why = reason or (req.finish_reason.value if req.finish_reason else "abort")
        summary = req.summary(now)
        self.stats.count_slo(req, now, completed=why in ("stop", "length"))
        if self.trace is not None:
            self.trace.request_done(req, now)
        log.info("finish", finish_reason=why, **({"tenant": req.tenant} if req.tenant else {}),
                 **summary)
        self._send(req.request_id,
                   StreamEvent(tokens, req.num_output_tokens, why, summary, error,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               cached_tokens=req.num_cached_tokens or 0))
        route = self.streams.pop(req.request_id, None)
        group = route.stream_id if route is not None else ""
        if group in self.groups and not any(m in self.streams for m in self.groups[group]):
            del self.groups[group]  # the group's last choice: its id is free again

    def _send(self, request_id: str, event: StreamEvent) -> None:
        route = self.streams.get(request_id)
        if route is not None:
            event.index = route.index
            route.sink.deliver(route.stream_id, event)
            self._dirty.add(route.sink)

    # -- failures ---------------------------------------------------------------------------
    def _on_failure(self, error: Exception) -> None:
        """An iteration (or a recovery) failed: start or continue an outage; give up when
        it lasts too long, or when iterations keep failing while the peers look healthy."""
        self.stats.backend_errors += 1
        if self._outage is None:  # the iteration failed, not a recovery still waiting
            self._attempts += 1
        if isinstance(error, grpc.aio.AioRpcError):
            what = f"{error.code().name}: {error.details()}"
        else:
            what = f"{type(error).__name__}: {error}"
        failed = self.core.take_unsure()
        outage = self._outage
        if outage is None:
            outage = self._outage = _Outage(time.monotonic(), failed, self._unconfirmed, what)
            self._unconfirmed = []
            log.warning("iteration_failed", error=what, live_requests=len(self.scheduler.requests),
                        failed_transfers=[p.fence for p in failed])
        else:  # cannot happen (plans fail only in a step); be safe
            outage.failed += failed
        waited = time.monotonic() - outage.since
        if waited > self.peer_timeout_s:
            self._fail_all(f"the worker or kvmem has not been serving for {waited:.0f} s "
                           f"(last error: {what}); retry later")
        elif self._attempts >= MAX_FAILED_ATTEMPTS:
            # The peers answer but every attempt fails: a bug, not a restart. Retrying
            # forever would hang every stream.
            log.error("iteration_failed_repeatedly", attempts=self._attempts, error=what,
                      exc_info=error)
            self._fail_all(f"the engine failed {self._attempts} times in a row ({what})")

    async def _recover(self, outage: _Outage) -> None:
        """Wait for both peers, re-attach kvmem to the worker's pool, repair request state.

        Raises (and is retried by `run`) while a peer is still away.
        """
        def left() -> float:
            return max(0.5, outage.since + self.peer_timeout_s - time.monotonic())

        await self.worker.wait_serving(left())
        handle = await self.worker.kv_pool()
        cfg = self.scheduler.config
        if handle.shape[0] != cfg.num_device_blocks or handle.shape[3] != cfg.block_size:
            raise BackendMismatch(
                f"the worker's pool is now {handle.shape[0]} blocks of {handle.shape[3]} "
                f"tokens; this scheduler was built for {cfg.num_device_blocks} of "
                f"{cfg.block_size}: restart the scheduler"
            )
        if cfg.model_id:
            info = await self.worker.model_info()
            if model_identity(info.source_path, info.dtype) != cfg.model_id:
                # The KV this scheduler caches (and every stream's context) is another
                # model's: nothing may resume on this worker.
                raise BackendMismatch(
                    f"the worker now serves {info.source_path} ({info.dtype}); this scheduler "
                    f"was built for {cfg.model_id.replace('|', ' (')}): restart the scheduler")
        await self.kvmem.wait_serving(left())
        reply = await self.kvmem.attach(handle)
        if reply.host_blocks != cfg.num_host_blocks:
            raise BackendMismatch(
                f"kvmem now has {reply.host_blocks} host blocks, this scheduler was built for "
                f"{cfg.num_host_blocks}: restart the scheduler"
            )
        device = handle.pool_id != self.pool_id
        host = reply.host_pool_id != self.host_pool_id
        suspect = list(outage.failed)
        if device:
            suspect += outage.unconfirmed
        rec = None
        if device or host or suspect:
            rec = self.scheduler.kv_lost(device=device, host=host, failed=_merged(suspect))
        else:
            # Both pools survived: only the batches in flight are lost (the worker has
            # stopped writing: it answered GetKVPool, which waits for a running forward).
            self.scheduler.abandon_in_flight()
        self.pool_id, self.host_pool_id = handle.pool_id, reply.host_pool_id
        self._outage = None
        if device or host:
            self._attempts = 0  # a peer really restarted: not a failure that repeats
        st = self.stats
        st.recoveries += 1
        st.device_losses += device
        st.host_losses += host
        st.last_outage_s = time.monotonic() - outage.since
        if rec is not None:
            st.resumed_swap_in += len(rec.swap_in)
            st.resumed_recompute += len(rec.recompute)
        log.warning("recovered", outage_s=round(st.last_outage_s, 3), error=outage.error,
                    device_pool_lost=device, host_pool_lost=host,
                    failed_transfers=[p.fence for p in outage.failed],
                    pool_id=self.pool_id, **(rec.as_dict() if rec else {}))

    def _fail_all(self, why: str) -> None:
        """End every live request with `why` (its stream fails with UNAVAILABLE).

        Only when recovery is impossible: a peer did not come back in time, came back
        with other pools, or keeps failing; or the scheduler is shutting down.
        """
        live = list(self.scheduler.requests)
        log.error("requests_failed", error=why, failed_requests=len(live))
        # Batches in flight are given up with their requests (a worker that still runs one
        # runs the next batch only after it: see worker/batches.py).
        self.scheduler.abandon_in_flight()
        for rid in live:
            self.scheduler.abort(rid)
        self._publish([], reason="error", error=why)
        self._outage = None
        self._attempts = 0


def _merged(plans: list[TransferPlan]) -> TransferPlan | None:
    """One plan with every copy of `plans` (what kv_lost needs to know), or None."""
    if not plans:
        return None
    return TransferPlan(
        fence=plans[-1].fence,
        swap_out=[pair for p in plans for pair in p.swap_out],
        swap_in=[pair for p in plans for pair in p.swap_in + p.late_swap_in],
        eager=[pair for p in plans for pair in p.eager],
    )


class _WorkerLane:
    """The worker as the core's Executor: the loop's current pool id on every batch."""

    def __init__(self, loop: ServingLoop) -> None:
        self.loop = loop

    async def execute(
        self, iteration: int, chunks: list[ScheduledChunk], after: int = 0,
        released: Sequence[str] = (),
    ) -> ExecuteResult:
        loop = self.loop
        before = list(loop._unconfirmed)
        result = await loop.worker.execute(iteration, chunks, loop.pool_id, after, released)
        # The pool (this pool id: this worker process) lived through the copies that were
        # done before this batch was sent; later ones wait for the next batch.
        loop._unconfirmed = [p for p in loop._unconfirmed if p not in before]
        return result


class _KVMemLane:
    """kvmem as the core's TransferEngine, remembering what recovery must know: the batches
    that read the device pool since the worker last computed (the core itself keeps the
    batches a failed step left in doubt)."""

    def __init__(self, loop: ServingLoop) -> None:
        self.loop = loop

    async def transfer(self, plan: TransferPlan) -> TransferResult:
        loop = self.loop
        reply = await loop.kvmem.transfer(plan, loop.pool_id)
        if plan.swap_out or plan.eager:
            loop._unconfirmed.append(plan)
        return TransferResult(reply.d2h_s, reply.h2d_s, reply.total_s, reply.bytes_d2h,
                              reply.bytes_h2d)
