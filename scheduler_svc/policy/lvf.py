"""Largest-VLT-First (DESIGN §4): rotate requests by how far they lag their SLOs."""

from __future__ import annotations

from scheduler_svc.policy.base import Policy, RotationLimits
from scheduler_svc.policy.vlt import VLTParams, vlt
from scheduler_svc.request import Request


class LVFPolicy(Policy):
    name = "lvf"
    offload = True
    fcfs_when_fits = True
    skip_unservable = True

    def __init__(self, params: VLTParams, limits: RotationLimits) -> None:
        self.params = params
        self.limits = limits

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        # Highest VLT first, ties to the earlier arrival. Keys are computed once per call
        # and sorted in C: this runs over every live request each iteration.
        keys = [(-vlt(r, now, self.params), r.arrival_time) for r in reqs]
        return [reqs[i] for i in sorted(range(len(reqs)), key=keys.__getitem__)]

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        return self._order(waiting + rotary, now)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        # The tail (lowest VLT: ran longest since admission) is preempted first.
        return self._order(running, now)

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        v = vlt(victim, now, self.params)
        return v < 0.0 and v < vlt(candidate, now, self.params) - self.limits.vlt_margin
