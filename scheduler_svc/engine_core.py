"""The engine step: plan → transfer → execute → update, written once.

`EngineCore.step()` is the only place the iteration is written. The scheduler service
(over gRPC), `superinfer generate` (local objects) and the simulator (cost models on a
simulated clock) each inject an `Executor` and a `TransferEngine` and call it; what they
add around it is their own: publishing tokens to streams and recovering from a lost peer,
stop strings, arrivals and metrics.

The step keeps the DuplexKV contract (DESIGN §3): a plan's fence is released only once its
copies are done — or failed, in which case nothing copies any more and the caller's
recovery treats the plan's writes as lost — and the batch runs only after its swap-ins
have landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from common.contracts import ExecuteResult, TransferResult
from scheduler_svc.interfaces import Executor, SchedulerOutput, TransferEngine
from scheduler_svc.scheduler import RequestEvent, Scheduler
from scheduler_svc.trace import Trace, scheduler_load


@dataclass(slots=True)
class EngineStats:
    """What the steps cost, cumulative (the names /metrics and `generate --json` show)."""

    transfers: int = 0
    transfer_s: float = 0.0  # wall time of transfer calls (RPC included in the service)
    transfer_wait_max_s: float = 0.0  # the longest one iteration waited on its transfers
    kvmem_d2h_s: float = 0.0  # the transfer engine's own busy time per direction
    kvmem_h2d_s: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    executes: int = 0
    execute_s: float = 0.0  # the executor's compute time
    execute_rpc_s: float = 0.0  # wall time of execute calls (RPC included in the service)

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(slots=True)
class StepResult:
    out: SchedulerOutput
    events: list[RequestEvent]
    transfer: TransferResult | None = None
    execute: ExecuteResult | None = None

    @property
    def busy(self) -> bool:
        """False when the iteration had nothing to run or move (every request blocked)."""
        return bool(self.out.chunks or self.out.transfers)


class EngineCore:
    """One scheduler, one executor, one transfer engine; `await step()` runs an iteration.

    `timer` measures the calls' durations: wall time by default, the simulated clock in
    the simulator. The trace (when given) places spans on the scheduler's clock.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        transfers: TransferEngine,
        trace: Trace | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.transfers = transfers
        self.trace = trace
        self.timer = timer
        self.stats = EngineStats()

    async def step(self) -> StepResult:
        sched, st, timer = self.scheduler, self.stats, self.timer
        start = sched.clock()
        out = sched.schedule()
        plan = out.transfers
        moved: TransferResult | None = None
        xfer_span: tuple[float, float] | None = None
        if plan is not None:
            t_start, t0 = sched.clock(), timer()
            try:
                moved = await self.transfers.transfer(plan)
            finally:
                # Released even on failure: nothing copies any more (a peer is gone, or
                # refused the batch), and recovery treats the batch's writes as lost.
                sched.complete_transfer(plan.fence)
            waited = timer() - t0
            xfer_span = (t_start, waited)
            st.transfers += 1
            st.transfer_s += waited
            st.transfer_wait_max_s = max(st.transfer_wait_max_s, waited)
            st.kvmem_d2h_s += moved.d2h_s
            st.kvmem_h2d_s += moved.h2d_s
            st.bytes_d2h += moved.bytes_d2h
            st.bytes_h2d += moved.bytes_h2d
        result: ExecuteResult | None = None
        exec_span: tuple[float, float] | None = None
        if out.chunks:
            t_start, t0 = sched.clock(), timer()
            result = await self.executor.execute(out.iteration, out.chunks)
            called = timer() - t0
            exec_span = (t_start, called)
            st.executes += 1
            st.execute_s += result.execute_s
            st.execute_rpc_s += called
        events = sched.update_from_output(out, result or ExecuteResult(sampled={}))
        if self.trace is not None:
            self.trace.iteration(
                out, start, transfer=xfer_span,
                d2h_s=moved.d2h_s if moved else 0.0, h2d_s=moved.h2d_s if moved else 0.0,
                execute=exec_span, execute_s=result.execute_s if result else None,
                load=scheduler_load(sched),
            )
        return StepResult(out, events, moved, result)
