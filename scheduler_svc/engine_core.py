"""The engine step: plan → transfer → execute → update, written once.

`EngineCore.step()` is the only place the iteration is written. The scheduler service
(over gRPC), `superinfer generate` (local objects) and the simulator (cost models on a
simulated clock) each inject an `Executor` and a `TransferEngine` and call it; what they
add around it is their own: publishing tokens to streams and recovering from a lost peer,
stop strings, arrivals and metrics.

The step has two depths (`pipeline`), written in one function (`_step`):

* serial (`--no-pipeline`, the baseline): plan t, copy its blocks, run its batch, apply
  its output. The worker idles while the scheduler plans and kvmem copies.
* pipelined (the default; DuplexKV's cross-iteration pipeline, DESIGN §5): while batch t
  runs, plan t+1 against the state t will leave (`scheduler.schedule()` counts t's chunks
  as computed and its samples as placeholders), copy t+1's swap-ins into free blocks, and
  send batch t+1 so that it queues behind t on the worker, which fills each placeholder
  with its own sample from t (`worker/batches.py`). t+1's eager copies start then, in the
  background: no batch waits for them. Then t's output lands. Rotate-outs of t+1 (t writes
  their last block) and swap-ins into blocks t may still read are copied after t; batch
  t+1 waits for them only when it reads such a swap-in, which the scheduler avoids by
  starting the request they are for one batch later. The eager and after-batch copies run
  beside batch t+1 and are awaited before planning t+2, so planning never hands out a
  block a copy still touches.

Fences (DESIGN §3) hold across the overlap: a plan's fence is released once all of its
copies are done — or failed, in which case nothing copies any more and the caller's
recovery treats the plan's writes as lost — and a batch runs only after the swap-ins it
reads have landed. Blocks released while a batch is in flight wait for it
(`BlockManager.begin_execute`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from common.contracts import ExecuteResult, TransferPlan, TransferResult
from scheduler_svc.interfaces import Executor, SchedulerInterface, SchedulerOutput, TransferEngine
from scheduler_svc.policy.xfer_budget import LinkRate
from scheduler_svc.scheduler_config import RequestEvent
from scheduler_svc.trace import Trace


@dataclass(slots=True)
class EngineStats:
    """What the steps cost, cumulative (the names /metrics and `generate --json` show)."""

    transfers: int = 0  # transfer calls (a pipelined iteration may make two)
    transfer_s: float = 0.0  # wall time of transfer calls (RPC included in the service)
    transfer_wait_s: float = 0.0  # time the step itself waited on transfers
    transfer_wait_max_s: float = 0.0  # the longest one iteration waited on its transfers
    transfer_stall_s: float = 0.0  # ... of which the worker sat idle (nothing else to run)
    kvmem_d2h_s: float = 0.0  # the transfer engine's own busy time per direction
    kvmem_h2d_s: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    executes: int = 0
    execute_s: float = 0.0  # the executor's compute time
    execute_rpc_s: float = 0.0  # wall time of execute calls (RPC and queueing included)
    execute_wait_s: float = 0.0  # time the step waited for a batch's output

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(slots=True)
class StepResult:
    out: SchedulerOutput  # the iteration this step planned
    events: list[RequestEvent]  # tokens that landed (pipelined: the batch before `out`'s)
    transfer: TransferResult | None = None
    execute: ExecuteResult | None = None
    in_flight: bool = False  # a batch or copies are still running after the step

    @property
    def busy(self) -> bool:
        """False when the iteration had nothing to run or move (every request blocked)."""
        return bool(self.out.chunks or self.out.transfers or self.events or self.in_flight)


@dataclass(slots=True)
class _Batch:
    out: SchedulerOutput
    task: asyncio.Task[ExecuteResult]
    launched: float  # timer()


@dataclass(slots=True)
class _Copies:
    """A plan's copies in the background: its parts in the order sent (the transfer engine
    runs them one after another), each with its task and start (scheduler clock)."""

    plan: TransferPlan
    jobs: list[tuple[TransferPlan, asyncio.Task[TransferResult], float]] = field(
        default_factory=list)

    def tasks(self) -> list[asyncio.Task[TransferResult]]:
        return [task for _, task, _ in self.jobs]


class EngineCore:
    """One scheduler, one executor, one transfer engine; `await step()` runs an iteration.

    `timer` measures the calls' durations: wall time by default, the simulated clock in
    the simulator. The trace (when given) places spans on the scheduler's clock.
    """

    def __init__(
        self,
        scheduler: SchedulerInterface,
        executor: Executor,
        transfers: TransferEngine,
        trace: Trace | None = None,
        timer: Callable[[], float] = time.perf_counter,
        pipeline: bool = False,
        auto_xfer_budget: bool = False,
    ) -> None:
        if pipeline and not scheduler.pipelined:
            raise ValueError("a pipelined step needs a scheduler built with pipelined=True")
        self.scheduler = scheduler
        self.executor = executor
        self.transfers = transfers
        self.trace = trace
        self.timer = timer
        self.pipeline = pipeline
        # B_xfer "auto" (--xfer-budget-blocks): from the copies' measured rate.
        cfg = scheduler.config
        self._link = (LinkRate(floor=-(-cfg.max_model_len // cfg.block_size))
                      if auto_xfer_budget else None)
        self.stats = EngineStats()
        self._batch: _Batch | None = None  # pipelined: the batch in flight
        self._after: _Copies | None = None  # pipelined: eager and after-batch copies in flight
        # Plans some of whose copies may not have happened: a step failed while they ran,
        # or before they could start. Recovery treats their writes as lost.
        self._unsure: list[TransferPlan] = []
        # Worker idle since (timer; None: busy or never ran) and this step's transfer waits,
        # to charge a batch's requests with the idle time their copies caused.
        self._idle_since: float | None = None
        self._step_wait = 0.0
        self._landed: list[RequestEvent] = []

    def take_landed(self) -> list[RequestEvent]:
        """The tokens that landed since the last call. A step or drain that fails after a
        batch's output landed still returns them here: the requests hold those tokens, so
        their streams must get them before recovery."""
        out, self._landed = self._landed, []
        return out

    def _land(self, out: SchedulerOutput, result: ExecuteResult) -> None:
        self._landed += self.scheduler.update_from_output(out, result)

    def take_unsure(self) -> list[TransferPlan]:
        """The plans whose copies a failed step left in doubt (and forget them)."""
        out, self._unsure = self._unsure, []
        return out

    async def step(self) -> StepResult:
        try:
            return await self._step()
        except BaseException:
            await self._stop_tasks()
            raise

    @property
    def idle(self) -> bool:
        """No batch and no copies in flight."""
        return self._batch is None and self._after is None

    async def _step(self) -> StepResult:
        """The iteration, at pipeline depth 0 (serial) or 1 (pipelined): the module doc."""
        sched, pipelined = self.scheduler, self.pipeline
        await self._finish_after()  # planning must not hand out blocks those copies touch
        if self._batch is not None and self._batch.out.num_draft_tokens:
            # How far its speculating requests got decides the next plan: land it first.
            await self._land_batch()
        # -- plan
        start = sched.clock()
        out = sched.schedule()
        plan = out.transfers
        # -- transfer what the batch needs first: serial, the whole plan; pipelined, the
        # swap-ins into free blocks (eager copies go beside the batch; rotate-outs and
        # swap-ins into blocks the batch in flight reads, after it).
        first = plan if not pipelined else (
            plan.before_batch() if plan is not None and plan.swap_in else None)
        late = (plan.after_batch() or None) if pipelined and plan is not None else None
        moved: TransferResult | None = None
        span: tuple[float, float] | None = None
        if plan is not None and first is not None:
            t_start, t0 = sched.clock(), self.timer()
            try:
                moved = await self._copy(first)
            except BaseException:
                self._give_up(plan)
                raise
            span = (t_start, self._waited(t0))
            if not pipelined:
                sched.complete_transfer(plan.fence)  # all of its copies are done
        # -- execute: serial, this batch; pipelined, launch it behind the one in flight
        # (unless it reads blocks only the after-batch swap-ins fill: the scheduler defers
        # the requests they are for) and take that one's output.
        result: ExecuteResult | None = None
        prev = self._batch
        after = prev.out.iteration if prev is not None else 0
        wait_for_copies = late is not None and _reads(out, late.swap_in)
        if not pipelined:
            if out.chunks:
                self._charge_stall(out, worker_busy=False)
                t0 = self.timer()
                result = await self.executor.execute(out.iteration, out.chunks,
                                                     released=out.released)
                called = self.timer() - t0
                self._executed(result, called, called)
                self._idle_since = self.timer()
            # -- update
            self._land(out, result or ExecuteResult(sampled={}))
        else:
            busy = prev is not None and not prev.task.done()
            self._batch = (self._launch(out, after, busy) if out.chunks and not wait_for_copies
                           else None)
            if plan is not None:
                if plan.eager:
                    # Sent after the swap-ins and the batch: the transfer engine runs plans in
                    # order, so no batch waits behind these (DESIGN §5). The next plan waits
                    # for them (_finish_after).
                    self._start_copies(plan, plan.beside_batch())
                elif late is None:
                    sched.complete_transfer(plan.fence)  # all of its copies are done
            try:
                if prev is not None:
                    t0 = self.timer()
                    result = await prev.task
                    self._executed(result, self.timer() - prev.launched, self.timer() - t0)
                    # -- update (the batch before this one)
                    self._land(prev.out, result)
            except BaseException:
                if late is not None and self._after is None and plan is not None:
                    self._give_up(plan)  # its after-batch copies never start
                raise
        if late is not None and plan is not None:
            self._start_copies(plan, late)
            if wait_for_copies and out.chunks:
                await self._finish_after()  # the batch reads those blocks
                self._batch = self._launch(out, after, False)
        self._trace(out, start, span, moved, result,
                    prev.out if pipelined and prev is not None else None)
        return StepResult(out, self.take_landed(), moved, result,
                          in_flight=pipelined and not self.idle)

    def _give_up(self, plan: TransferPlan) -> None:
        """Copies of `plan` failed or will never run: nothing copies any more (a peer is
        gone, or refused the batch), so its fence is released, and recovery treats its
        writes as lost (take_unsure)."""
        self._unsure.append(plan)
        self.scheduler.complete_transfer(plan.fence)

    def _launch(self, out: SchedulerOutput, after: int, worker_busy: bool) -> _Batch:
        self._charge_stall(out, worker_busy)
        task = asyncio.create_task(self.executor.execute(out.iteration, out.chunks, after,
                                                         released=out.released))
        task.add_done_callback(self._batch_done)
        return _Batch(out, task, self.timer())

    def _batch_done(self, task: asyncio.Task[ExecuteResult]) -> None:
        self._idle_since = self.timer()

    def _charge_stall(self, out: SchedulerOutput, worker_busy: bool) -> None:
        """A batch is sent: the worker idled before it for as long as it waited, up to this
        step's waits on copies; charge that to the batch's requests (SLO attribution)."""
        waited, self._step_wait = self._step_wait, 0.0
        since = self._idle_since
        if worker_busy or since is None or waited <= 0.0:
            return
        stall = min(waited, max(0.0, self.timer() - since))
        if stall > 0.0:
            self.stats.transfer_stall_s += stall
            self.scheduler.charge_transfer_stall(out, stall)

    def _start_copies(self, plan: TransferPlan, part: TransferPlan) -> None:
        """Copy `part` of `plan` in the background; the plan's fence is released once all
        of its background parts are done (_finish_after)."""
        if self._after is None:
            self._after = _Copies(plan)
        task = asyncio.create_task(self._copy(part))
        self._after.jobs.append((part, task, self.scheduler.clock()))

    async def _finish_after(self) -> None:
        copies = self._after
        if copies is None:
            return
        t0 = self.timer()
        try:
            for part, task, started in copies.jobs:
                moved = await task
                if self.trace is not None:
                    self._trace_copies(part, started, moved)
        except BaseException:
            await _stop(copies.tasks())
            self._after = None
            self._give_up(copies.plan)
            raise
        self._after = None
        self.scheduler.complete_transfer(copies.plan.fence)
        self._waited(t0)

    async def _stop_tasks(self) -> None:
        """A step failed: stop waiting for what this core started (the work itself may go
        on at a peer; recovery waits for the peers) and release the open fences."""
        batch, copies = self._batch, self._after
        self._batch = self._after = None
        jobs: list[asyncio.Task[Any]] = [batch.task] if batch else []
        await _stop(jobs + (copies.tasks() if copies else []))
        if copies is not None:
            self._give_up(copies.plan)

    async def _land_batch(self) -> None:
        """Wait for the batch in flight and apply its output."""
        if self._batch is not None:
            batch, self._batch = self._batch, None
            t0 = self.timer()
            result = await batch.task
            self._executed(result, self.timer() - batch.launched, self.timer() - t0)
            self._land(batch.out, result)

    async def drain(self) -> list[RequestEvent]:
        """Let the batch and copies in flight finish; return the tokens that landed."""
        try:
            await self._land_batch()
            await self._finish_after()
        except BaseException:
            await self._stop_tasks()
            raise
        return self.take_landed()

    # -- accounting ---------------------------------------------------------------------------
    async def _copy(self, plan: TransferPlan) -> TransferResult:
        t0 = self.timer()
        moved = await self.transfers.transfer(plan)
        st = self.stats
        st.transfers += 1
        st.transfer_s += self.timer() - t0
        st.kvmem_d2h_s += moved.d2h_s
        st.kvmem_h2d_s += moved.h2d_s
        st.bytes_d2h += moved.bytes_d2h
        st.bytes_h2d += moved.bytes_h2d
        if self._link is not None:
            self._link.observe(plan, moved)
            self.scheduler.set_xfer_budget(self._link.budget())
        return moved

    def _waited(self, since: float) -> float:
        """The step waited on transfers from `since` (timer) until now; returns how long."""
        seconds = self.timer() - since
        self._step_wait += seconds
        self.stats.transfer_wait_s += seconds
        self.stats.transfer_wait_max_s = max(self.stats.transfer_wait_max_s, seconds)
        return seconds

    def _executed(self, result: ExecuteResult, call_s: float, waited_s: float) -> None:
        st = self.stats
        st.executes += 1
        st.execute_s += result.execute_s
        st.execute_rpc_s += call_s
        st.execute_wait_s += waited_s

    def _trace(self, out: SchedulerOutput, start: float, span: tuple[float, float] | None,
               moved: TransferResult | None, result: ExecuteResult | None,
               executed: SchedulerOutput | None = None) -> None:
        if self.trace is None:
            return
        # The worker's compute, drawn where it ended (the batch's output just landed).
        now = self.scheduler.clock()
        execute = (now - result.execute_s, result.execute_s) if result is not None else None
        self.trace.iteration(
            out, start, transfer=span,
            d2h_s=moved.d2h_s if moved else 0.0, h2d_s=moved.h2d_s if moved else 0.0,
            execute=execute, execute_s=result.execute_s if result else None,
            executed=executed, load=self.scheduler.load(),
        )

    def _trace_copies(self, plan: TransferPlan, start: float, moved: TransferResult) -> None:
        assert self.trace is not None
        self.trace.copies(plan, start, moved.total_s, moved.d2h_s, moved.h2d_s)


async def _stop(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel what is still running and wait for every task to end (errors swallowed: the
    caller is already failing)."""
    for task in tasks:
        if not task.done():
            task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def _reads(out: SchedulerOutput, copies: list[tuple[int, int]]) -> bool:
    """Does the batch read any block these (host, device) copies fill?"""
    if not copies:
        return False
    filled = {d for _, d in copies}
    return any(b in filled for c in out.chunks for b in c.block_table)
