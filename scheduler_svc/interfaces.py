"""The scheduler core's two boundaries: an executor (runs a batch) and a transfer engine
(moves KV blocks between tiers). Services implement them over gRPC, `superinfer generate`
with local objects, the simulator with cost models (DESIGN §1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan


@dataclass(slots=True)
class SchedulerOutput:
    iteration: int
    chunks: list[ScheduledChunk]
    transfers: TransferPlan | None
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    decision_s: float = 0.0
    rotated_out: list[str] = field(default_factory=list)
    rotated_in: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Executor(Protocol):
    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult: ...


class TransferEngine(Protocol):
    def transfer(self, plan: TransferPlan) -> None:
        """Carry out every copy in `plan`; return when all are complete."""
        ...
