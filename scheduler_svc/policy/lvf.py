"""Largest-VLT-First (DESIGN §4): rotate requests by how far they lag their SLOs."""

from __future__ import annotations

from scheduler_svc.policy.base import Policy, RotationLimits
from scheduler_svc.policy.vlt import VLTParams, vlt
from scheduler_svc.request import Request


class LVFPolicy(Policy):
    name = "lvf"
    offload = True
    fcfs_when_fits = True

    def __init__(self, params: VLTParams, limits: RotationLimits) -> None:
        self.params = params
        self.limits = limits

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        # Ties (equal VLT) go to the earlier arrival so the order is deterministic.
        return sorted(waiting + rotary, key=lambda r: (-vlt(r, now, self.params), r.arrival_time))

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        # Highest VLT first; the tail (lowest VLT: ran longest since admission) is preempted.
        return sorted(running, key=lambda r: (-vlt(r, now, self.params), r.arrival_time))

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        v = vlt(victim, now, self.params)
        return v < 0.0 and v < vlt(candidate, now, self.params) - self.limits.vlt_margin
