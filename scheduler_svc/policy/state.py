"""What the scheduling decisions see: the types `policy/`'s decision functions take.

The decisions (which running requests get their tokens, whether to rotate, whom to admit,
whom to preempt) are functions in `policy/` over these types, never over the `Scheduler`
or the `BlockManager` classes (an import-linter contract says so): the scheduler passes
itself as a `SchedulingState`, a test passes a hand-built one. `BlockView` is the part of
the block manager the decisions ask about; `Plan` is one iteration's plan as it is built.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from scheduler_svc.policy.base import Policy
from scheduler_svc.policy.shares import Ledger
from scheduler_svc.queue import Entry
from scheduler_svc.request import Request, RequestState


@dataclass(slots=True)
class Plan:
    """Mutable state of one schedule() call."""

    now: float
    budget: int
    tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens scheduled
    # request_id -> the drafts its decode chunk verifies (counted in `tokens`)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    preempted: bool = False
    xfer_used: int = 0
    out: list[str] = field(default_factory=list)
    into: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    displaced: set[str] = field(default_factory=set)  # preempted this iteration
    reserve: int = 0  # free device blocks admission leaves for running requests to grow
    # Per victim, for this iteration's admission walk (it asks about the same victims for
    # candidate after candidate): (blocks a rotate-out copies, device blocks preempting it
    # releases, how many of those the copy keeps busy, whether those two stay valid).
    victim_blocks: dict[str, tuple[int, int, int, bool]] = field(default_factory=dict)
    victim_head: int = 0  # victims before this index are off the device already
    # Upper bounds on the device blocks that preempting every victim still running would
    # release, (for compute, for a swap-in), kept up to date as victims go; per victim,
    # what it adds. A candidate needing more beyond the free room cannot be served.
    releasable: list[int] = field(default_factory=lambda: [0, 0])
    victim_bound: dict[str, tuple[int, int]] = field(default_factory=dict)


class Rotation(NamedTuple):
    """What `rotation_needed` found: whether to rotate this iteration, the candidates in
    the order to try them, the parked ones that go first (admission holds blocks for
    them), the slack under which a parked candidate may preempt (None: as the policy's
    may_preempt says), and, while it may not yet, the device blocks each running request
    grows into before the next request is expected to finish."""

    needed: bool
    queue: Iterable[Request]
    hold: frozenset[str]
    parked_within_s: float | None
    growth_blocks_per_seat: float = 0.0


@dataclass(frozen=True, slots=True)
class RotationInputs:
    """What the rotation decision reads of the scheduler (policy/rotation.py)."""

    policy: Policy
    running: int  # requests on the device
    seat_limit: int  # seats this iteration
    block_size: int
    finish_rate: Callable[[float, float], float]  # (now, window_s) -> finishes per second


class DeviceTable(Protocol):
    """One request's block table, as the decisions read it."""

    device: list[int | None]


class BlockView(Protocol):
    """The block manager's answers the decisions need (scheduler_svc/block_manager.py)."""

    @property
    def tables(self) -> Mapping[str, DeviceTable]: ...
    @property
    def num_free_for_compute(self) -> int: ...
    @property
    def num_free_for_swap_in(self) -> int: ...
    @property
    def num_late_swap_in(self) -> int: ...
    @property
    def caches_device_blocks(self) -> bool: ...
    @property
    def same_iteration_reuse(self) -> bool: ...
    @property
    def prefix_caching(self) -> bool: ...

    def blocks_for(self, num_tokens: int) -> int: ...
    def try_grow(self, req: Request, num_new_tokens: int) -> bool: ...
    def admission(self, req: Request, budget: int) -> tuple[int, int, int]: ...
    def num_device_blocks_of(self, req: Request) -> int: ...
    def preemption_blocks(self, req: Request, rotate: bool) -> tuple[int, int, int]: ...
    def released_by_preempting(self, req: Request, rotate: bool) -> tuple[int, int]: ...


class Queue(Protocol):
    """A request queue (scheduler_svc/queue.py) as the decisions read it."""

    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    # Sorted runs, each of one priority class (policy/priority.py's order_key files them).
    def groups(self) -> builtins.list[builtins.list[Entry]]: ...
    def live_groups(self) -> builtins.list[builtins.list[Entry]]: ...
    def list(self) -> builtins.list[Request]: ...
    def min_tokens(self) -> int | None: ...


class Speculation(Protocol):
    """What schedule_running asks of speculative decoding."""

    def drafts(self, req: Request, limit: int) -> list[int]:
        """At most `limit` drafts for a decode whose last token is known."""
        ...

    def sits_out(self, req: Request) -> bool:
        """Pipelined: should a request whose last token is in flight skip this plan, so
        that the next one can propose from that token?"""
        ...


class SchedulingState(Protocol):
    """The scheduler as its decisions see it, and the actions they take on it."""

    policy: Policy
    seat_limit: int  # seats this iteration (max_num_seqs, or fewer under a time budget)
    iteration: int
    shares: Ledger  # the tenants' service (policy/shares.py)

    @property
    def speculator(self) -> Speculation | None:
        """Speculative decoding (scheduler_svc/speculative.py); None: off."""
        ...

    @property
    def blocks(self) -> BlockView: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def pipelined(self) -> bool: ...
    @property
    def running(self) -> Queue: ...
    @property
    def waiting(self) -> Queue: ...
    @property
    def rotary(self) -> Queue: ...

    def preempt(self, victim: Request, plan: Plan) -> None:
        """Take a running request off the device: rotate it out, or recompute later."""

    def admit(self, q: Request, n: int, plan: Plan) -> bool:
        """Seat candidate `q` with `n` tokens to compute; False where its swap-in waits for
        the batch in flight (it computes from the next batch on)."""

    def rotation_inputs(self) -> RotationInputs: ...
    def count_growth_preemption(self) -> None: ...
    def count_parked_preemptions(self, n: int) -> None: ...


def first_running(victims: Sequence[Request], plan: Plan) -> int:
    """Index of the first victim still running: those before it were preempted this
    iteration (victims go lowest first, so the walks need not step over them again)."""
    head, running = plan.victim_head, RequestState.RUNNING
    while head < len(victims) and victims[head].state is not running:
        head += 1
    plan.victim_head = head
    return head
