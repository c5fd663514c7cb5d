"""The scheduler core as its drivers see it (`SchedulerInterface`), its two boundaries:
an executor (runs a batch) and a transfer engine (moves KV blocks between tiers), and
what one `schedule()` hands them.

Three implementations of each (DESIGN §1): gRPC clients in the scheduler service
(`scheduler_svc/loop.py`), local objects in `superinfer generate` (`superinfer/engine.py`),
cost models on a simulated clock in the simulator (`superinfer/sim/engine.py`). All three
are driven by the one engine step, `scheduler_svc/engine_core.py`.

Both are async: the service's calls are RPCs, and the step's shape must not change when a
call does wait (the pipelined step overlaps them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan, TransferResult

if TYPE_CHECKING:
    from scheduler_svc.policy.shares import Ledger
    from scheduler_svc.queue import RequestQueue
    from scheduler_svc.recovery import Recovery
    from scheduler_svc.request import Request
    from scheduler_svc.scheduler_config import RequestEvent, SchedulerConfig, SchedulerStats
    from scheduler_svc.speculative import Speculator


@dataclass(slots=True)
class SchedulerOutput:
    iteration: int
    chunks: list[ScheduledChunk]
    transfers: TransferPlan | None
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    decision_s: float = 0.0
    num_running: int = 0  # running requests once planned (some may get no tokens)
    rotated_out: list[str] = field(default_factory=list)
    rotated_in: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    # Each chunk's request's kv_epoch when it was planned: a chunk settles only KV that
    # still counts (scheduler.update_from_output / rollback).
    kv_epochs: dict[str, int] = field(default_factory=dict)
    # Requests finished since the last batch whose sampling state the worker may hold
    # (worker/sampling_state.py): it drops them before running this batch.
    released: list[str] = field(default_factory=list)
    # Draft tokens its chunks verify (speculative decoding): how far each of those requests
    # gets decides the next plan, so a pipelined step lands this batch before planning.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens


class Executor(Protocol):
    async def execute(
        self, iteration: int, chunks: list[ScheduledChunk], after: int = 0,
        released: Sequence[str] = (),
    ) -> ExecuteResult:
        """Run the batch (writes its KV into the device pool); return the sampled tokens.

        `after`: the batch it follows (0: none). It runs after that one, and a chunk whose
        last token is PLACEHOLDER takes the token that batch sampled for its request.
        `released`: finished requests whose sampling state the executor may drop first."""
        ...


class TransferEngine(Protocol):
    async def transfer(self, plan: TransferPlan) -> TransferResult:
        """Carry out every copy in `plan`; return when all are complete."""
        ...


class SchedulerInterface(Protocol):
    """What every driver of the scheduler core uses, whatever the policy: requests in and
    out, one iteration's plan, and its output back. `Scheduler` (scheduler.py) is the one
    implementation; the engine step, the service, the in-process engine and the simulator
    hold it through this."""

    clock: Callable[[], float]
    config: SchedulerConfig
    requests: dict[str, Request]  # every unfinished request by id
    waiting: RequestQueue
    running: RequestQueue
    rotary: RequestQueue  # started, KV parked in host memory
    stats: SchedulerStats
    shares: Ledger  # the tenants' service (policy/shares.py)
    speculator: Speculator | None  # speculative decoding (--speculative-config); None: off
    finished_log: list[Request]  # finished requests not yet collected

    @property
    def pipelined(self) -> bool:
        """Planned one iteration ahead (the pipelined step)."""

    def add_request(self, req: Request) -> None: ...
    def add_group(self, leader: Request, followers: list[Request]) -> None: ...
    def abort(self, request_id: str) -> bool: ...
    def stop(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def collect_finished(self) -> list[Request]: ...

    def schedule(self) -> SchedulerOutput:
        """Plan one iteration: its batch and its block copies."""

    def complete_transfer(self, fence: int) -> None:
        """The plan's copies with this fence are done (or failed): its blocks are free."""

    def update_from_output(self, out: SchedulerOutput, result: ExecuteResult
                           ) -> list[RequestEvent]:
        """The iteration's batch ran: its KV is settled and its sampled tokens land."""

    def charge_transfer_stall(self, out: SchedulerOutput, seconds: float) -> None: ...
    def set_xfer_budget(self, blocks: int | None) -> None: ...

    def abandon_in_flight(self) -> list[SchedulerOutput]:
        """Every batch in flight is lost (a peer failed): roll them back, newest first."""

    def kv_lost(self, *, device: bool = False, host: bool = False,
                failed: TransferPlan | None = None) -> Recovery:
        """Put every request where it can resume from after a peer lost KV memory."""

    def load(self) -> dict[str, float]:
        """Queue lengths and free blocks now (the trace's load track)."""
