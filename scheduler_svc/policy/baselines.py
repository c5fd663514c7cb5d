"""Baseline policies on the same engine (DESIGN §4), for side-by-side measurement.

All three run the running requests in admission order (the last admitted is the first
victim, vLLM's rule) and order candidates by arrival, with a class rank in front where a
policy serves one class first.
"""

from __future__ import annotations

from scheduler_svc.policy.base import BARE_LIMITS, OrderKey, RotationLimits, StaticOrderPolicy
from scheduler_svc.request import Request, RequestState


class FCFSPolicy(StaticOrderPolicy):
    """vLLM V1 default: no offload; a preempted request recomputes; strict arrival order."""

    name = "fcfs"
    uses_host_pool = False

    def __init__(self, limits: RotationLimits | None = None) -> None:
        self.limits = limits or BARE_LIMITS

    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        return 0, (req.arrival_time, req.request_id)


class SwappedFirstPolicy(StaticOrderPolicy):
    """vLLM 0.6 with swap preemption: running, then swapped, then new prefills.

    Victim = last admitted; no swap-in in an iteration that preempted.
    """

    name = "swapped-first"

    def __init__(self, limits: RotationLimits | None = None) -> None:
        self.limits = limits or BARE_LIMITS

    def may_swap_in(self, candidate: Request, preempted_this_iteration: bool) -> bool:
        return not preempted_this_iteration  # vLLM 0.6: no swap-in once it had to preempt

    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        rank = 0 if rotary else 1
        return rank, (rank, req.arrival_time, req.request_id)


class WaitingFirstPolicy(StaticOrderPolicy):
    """New prefills before swapped requests, preempting running ones to admit them."""

    name = "waiting-first"
    bounded_transfers = True

    def __init__(self, limits: RotationLimits | None = None) -> None:
        self.limits = limits or BARE_LIMITS

    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        rank = 1 if rotary else 0
        return rank, (rank, req.arrival_time, req.request_id)

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        return candidate.state is RequestState.WAITING and candidate.first_token_time is None
