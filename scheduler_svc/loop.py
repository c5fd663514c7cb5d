"""The scheduler service's one iteration loop: plan -> transfer -> execute -> update.

The same `Scheduler` core as `superinfer generate`, driven over gRPC: kvmem carries out
the iteration's block copies (and the fence is released only after they are done),
then the worker runs the batch. Each live request has an asyncio.Queue that its
`Generate` stream drains; everything here runs on the event loop's thread, so scheduler
state needs no lock — handlers and the loop take turns at `await` points.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields

import grpc
import structlog

from scheduler_svc.interfaces import ExecuteResult
from scheduler_svc.remote import RemoteKVMem, RemoteWorker
from scheduler_svc.request import Request
from scheduler_svc.scheduler import RequestEvent, Scheduler

log = structlog.get_logger()

IDLE_POLL_S = 0.002  # an iteration that scheduled nothing (all blocked) waits this long


class BackendMismatch(RuntimeError):
    """The worker or kvmem came back with pools the scheduler was not built for."""


@dataclass(slots=True)
class StreamEvent:
    """What one Generate stream receives: new tokens, and on the last event why it ended."""

    token_ids: list[int]
    output_tokens: int
    finish_reason: str | None = None
    summary: dict[str, object] | None = None


@dataclass(slots=True)
class LoopStats:
    transfers: int = 0
    transfer_s: float = 0.0  # wall time of Transfer calls, RPC included
    kvmem_d2h_s: float = 0.0
    kvmem_h2d_s: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    executes: int = 0
    execute_s: float = 0.0  # worker-side compute time
    execute_rpc_s: float = 0.0  # wall time of Execute calls, RPC included
    backend_errors: int = 0
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, float]:
        d = {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "started"}
        d["uptime_s"] = time.monotonic() - self.started
        return d


class ServingLoop:
    def __init__(
        self, scheduler: Scheduler, worker: RemoteWorker, kvmem: RemoteKVMem, pool_id: str
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.kvmem = kvmem
        self.pool_id = pool_id
        self.stats = LoopStats()
        self.streams: dict[str, asyncio.Queue[StreamEvent]] = {}
        self._work = asyncio.Event()
        self._stale = False  # a peer failed: re-read its pool before the next iteration

    # -- requests in and out (called by the gRPC handlers) ---------------------------------
    def knows(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or request_id in self.streams

    def submit(self, req: Request) -> asyncio.Queue[StreamEvent]:
        """Add a request (ValueError if the scheduler refuses it) and return its stream."""
        self.scheduler.add_request(req)
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.streams[req.request_id] = queue
        log.info("submit", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens,
                 max_tokens=req.sampling.max_tokens, ttft_slo=req.slo.ttft_s,
                 tbt_slo=req.slo.tbt_s)
        self._work.set()
        return queue

    def finish(self, request_id: str, reason: str) -> bool:
        """Abort RPC: "stop" (a stop string matched upstream) or anything else = abort."""
        s = self.scheduler
        found = s.stop(request_id) if reason == "stop" else s.abort(request_id)
        self._publish([])
        return found

    def drop(self, request_id: str) -> None:
        """The stream is gone (finished, or the client went away): free its blocks now."""
        self.streams.pop(request_id, None)
        if self.scheduler.abort(request_id):
            self._publish([])

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.scheduler.has_unfinished():
                self._work.clear()
                await self._work.wait()
                continue
            try:
                if self._stale:
                    await self._reattach()
                busy = await self.step()
            except Exception as e:  # the loop must outlive any one failed iteration
                self._fail_all(e)
                await asyncio.sleep(0.5)  # a peer is restarting; don't hammer it
                continue
            if not busy:
                await asyncio.sleep(IDLE_POLL_S)

    async def step(self) -> bool:
        """One iteration; False when it had nothing to do (every request blocked)."""
        sched = self.scheduler
        out = sched.schedule()
        plan = out.transfers
        t_xfer = 0.0
        if plan is not None:
            t0 = time.perf_counter()
            try:
                reply = await self.kvmem.transfer(plan, self.pool_id)
            finally:
                # Released even on failure: every request is failed then, and the blocks
                # the fence holds must return to the pool with them.
                sched.complete_transfer(plan.fence)
            t_xfer = time.perf_counter() - t0
            st = self.stats
            st.transfers += 1
            st.transfer_s += t_xfer
            st.kvmem_d2h_s += reply.d2h_s
            st.kvmem_h2d_s += reply.h2d_s
            st.bytes_d2h += reply.bytes_d2h
            st.bytes_h2d += reply.bytes_h2d
        result = ExecuteResult(sampled={})
        t_exec = 0.0
        if out.chunks:
            t0 = time.perf_counter()
            result = await self.worker.execute(out.iteration, out.chunks, self.pool_id)
            t_exec = time.perf_counter() - t0
            self.stats.executes += 1
            self.stats.execute_s += result.execute_s
            self.stats.execute_rpc_s += t_exec
        events = sched.update_from_output(out, result)
        self._publish(events)
        log.debug(
            "iteration", iteration=out.iteration, chunks=len(out.chunks),
            prefill_tokens=out.num_prefill_tokens, decode_tokens=out.num_decode_tokens,
            swap_out=len(plan.swap_out) if plan else 0, swap_in=len(plan.swap_in) if plan else 0,
            eager=len(plan.eager) if plan else 0, rotated_out=out.rotated_out,
            rotated_in=out.rotated_in, recomputed=out.recomputed, decision_s=out.decision_s,
            transfer_s=t_xfer, execute_s=result.execute_s, execute_rpc_s=t_exec,
            running=len(sched.running), waiting=len(sched.waiting), rotary=len(sched.rotary),
        )
        return bool(out.chunks or plan)

    # -- results to streams -------------------------------------------------------------------
    def _publish(self, events: list[RequestEvent], reason: str | None = None) -> None:
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
                self._send(ev.request_id, StreamEvent(ev.new_token_ids, n_out))
            else:
                self._final(req, ev.new_token_ids, now, reason)
        for req in finished.values():
            self._final(req, [], now, reason)

    def _final(self, req: Request, tokens: list[int], now: float, reason: str | None) -> None:
        why = reason or (req.finish_reason.value if req.finish_reason else "abort")
        summary = req.summary(now)
        log.info("finish", finish_reason=why, **summary)
        self._send(req.request_id, StreamEvent(tokens, req.num_output_tokens, why, summary))
        self.streams.pop(req.request_id, None)

    def _send(self, request_id: str, event: StreamEvent) -> None:
        queue = self.streams.get(request_id)
        if queue is not None:
            queue.put_nowait(event)

    # -- failures ---------------------------------------------------------------------------
    def _fail_all(self, error: Exception) -> None:
        """An iteration failed (a peer, usually): end every live request with a clear error.

        Resuming them from their host copies after a restart (DESIGN §6) is a later
        step; here no request is left waiting forever and no block leaks.
        """
        self.stats.backend_errors += 1
        live = list(self.scheduler.requests)
        if isinstance(error, grpc.aio.AioRpcError):
            log.error("backend_failed", code=error.code().name, error=error.details(),
                      failed_requests=len(live))
        else:
            log.error("iteration_failed", error=str(error), failed_requests=len(live),
                      exc_info=error)
        for rid in live:
            self.scheduler.abort(rid)
        self._publish([], reason="error")
        self._stale = True

    async def _reattach(self) -> None:
        """After a failure, map the worker's (maybe new) pool into kvmem again."""
        handle = await self.worker.kv_pool()
        cfg = self.scheduler.config
        if handle.shape[0] != cfg.num_device_blocks or handle.shape[3] != cfg.block_size:
            raise BackendMismatch(
                f"the worker's pool is now {handle.shape[0]} blocks of {handle.shape[3]} "
                f"tokens; this scheduler was built for {cfg.num_device_blocks} of "
                f"{cfg.block_size}: restart the scheduler"
            )
        reply = await self.kvmem.attach(handle)
        if reply.host_blocks != cfg.num_host_blocks:
            raise BackendMismatch(
                f"kvmem now has {reply.host_blocks} host blocks, this scheduler was built for "
                f"{cfg.num_host_blocks}: restart the scheduler"
            )
        if handle.pool_id != self.pool_id:
            log.warning("worker_pool_changed", old=self.pool_id, new=handle.pool_id)
        self.pool_id = handle.pool_id
        self._stale = False
