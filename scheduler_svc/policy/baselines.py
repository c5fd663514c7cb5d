"""Baseline policies on the same engine (DESIGN §4), for side-by-side measurement."""

from __future__ import annotations

from scheduler_svc.policy.base import Policy, RotationLimits, admission_order, arrival_order
from scheduler_svc.request import Request, RequestState


class FCFSPolicy(Policy):
    """vLLM V1 default: no offload; a preempted request recomputes; strict arrival order."""

    name = "fcfs"
    offload = False

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        return arrival_order(waiting + rotary)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        return admission_order(running)


class SwappedFirstPolicy(Policy):
    """vLLM 0.6 with swap preemption: running, then swapped, then new prefills.

    Victim = last admitted; no swap-in in an iteration that preempted.
    """

    name = "swapped-first"
    no_swap_in_after_preemption = True

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        return arrival_order(rotary) + arrival_order(waiting)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        return admission_order(running)


class WaitingFirstPolicy(Policy):
    """New prefills before swapped requests, preempting running ones to admit them."""

    name = "waiting-first"

    def __init__(self, limits: RotationLimits | None = None) -> None:
        self.limits = limits or RotationLimits()

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        return arrival_order(waiting) + arrival_order(rotary)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        return admission_order(running)

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        return candidate.state is RequestState.WAITING and candidate.first_token_time is None
