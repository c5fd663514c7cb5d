"""The one small interface every scheduling policy implements.

The scheduler (scheduler_svc/scheduler.py) owns the mechanics: token budget, blocks,
transfers. A policy only orders requests and says who may displace whom, so each policy
is a few pure functions a test can call on hand-built requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from scheduler_svc.request import Request


@dataclass(slots=True, frozen=True)
class RotationLimits:
    xfer_budget_blocks: int | None = None  # B_xfer: blocks rotated in+out per iteration
    min_residency: int = 0  # iterations a (re)admitted request is safe from proactive preemption
    vlt_margin: float = 0.0  # a victim must lag at least this much less than the candidate


class Policy(ABC):
    name: str = "?"
    # True: a preempted request parks its KV in host memory (rotary); False: recompute.
    offload: bool = True
    # True: while every live request fits in device memory, act as plain FCFS.
    fcfs_when_fits: bool = False
    # vLLM 0.6: no swap-in in an iteration that had to preempt.
    no_swap_in_after_preemption: bool = False
    # False: admission stops at the first request that cannot be served (strict order, as
    # vLLM); True: it skips that one and serves the next (LVF: the simulator measured the
    # strict rule blocking new requests behind a large rotary one, docs/sim/README.md).
    skip_unservable: bool = False
    limits: RotationLimits = RotationLimits()

    @abstractmethod
    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        """Requests to bring onto the device, most deserving first."""

    @abstractmethod
    def running_order(self, running: list[Request], now: float) -> list[Request]:
        """Running requests, most deserving first; preemption victims come from the tail."""

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        """May `victim` be rotated out to make room for `candidate` (proactive preemption)?

        Victims are offered from the tail of `running_order`; once one may not be
        preempted, no later one may either (the scheduler stops asking)."""
        return False


def arrival_order(reqs: list[Request]) -> list[Request]:
    return sorted(reqs, key=lambda r: (r.arrival_time, r.request_id))


def admission_order(reqs: list[Request]) -> list[Request]:
    """Oldest admission first: the last admitted is the first victim (vLLM's rule)."""
    return sorted(reqs, key=lambda r: (r.admitted_iteration, r.arrival_time, r.request_id))
