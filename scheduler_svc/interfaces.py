"""The scheduler core's two boundaries: an executor (runs a batch) and a transfer engine
(moves KV blocks between tiers). Services implement them over gRPC, `superinfer generate`
with local objects, the simulator with cost models (DESIGN §1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.block_manager import TransferPlan


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one request to run this iteration (a prefill chunk or one decode token)."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] (= the request's num_computed_tokens)
    # Device blocks covering positions [0, start_pos + len). The block manager's own list,
    # not a copy (copying every table every iteration was a quarter of the simulator's
    # time): read it before the next schedule(), copy it to keep it.
    block_table: list[int]
    sample: bool  # the chunk reaches the request's last token: sample the next one
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    output_index: int = 0  # tokens generated so far; with `seed`, makes sampling repeatable


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


@dataclass(slots=True)
class ExecuteResult:
    sampled: dict[str, int]  # request_id -> sampled token id (only chunks with sample=True)
    execute_s: float = 0.0


class Executor(Protocol):
    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult: ...


class TransferEngine(Protocol):
    def transfer(self, plan: TransferPlan) -> None:
        """Carry out every copy in `plan`; return when all are complete."""
        ...
