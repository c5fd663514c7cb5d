"""Largest-VLT-First (DESIGN §4): rotate requests by how far they lag their SLOs.

Groups for the lazy order (see policy/base.py): VLT depends on time only through
`now - anchor`, where the anchor is the arrival (no token yet), the last token (rotary,
or recomputing after a preemption) or the last admission (running), scaled by the
request's own SLO. Requests with the same formula and the same SLO therefore keep their
relative order forever: one group per (formula, SLO), sorted by anchor.
"""

from __future__ import annotations

from scheduler_svc.policy.base import OrderKey, Policy, RotationLimits, Unservable
from scheduler_svc.policy.vlt import VLTParams, vlt
from scheduler_svc.request import Request, RequestState


class LVFPolicy(Policy):
    name = "lvf"

    def __init__(self, params: VLTParams, limits: RotationLimits) -> None:
        self.params = params
        self.limits = limits

    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        # Highest VLT first = oldest anchor first within a group; ties to the earlier arrival.
        last = req.last_token_time
        if last is None:
            return ("ttft", req.slo.ttft_s), (req.arrival_time,)
        return ("tbt", req.slo.tbt_s), (last, req.arrival_time)

    def merge_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (-vlt(req, now, self.params), req.arrival_time)

    def running_key(self, req: Request) -> OrderKey:
        # A running request's VLT falls with time since its admission: the latest admitted
        # leads and the longest running is the first victim.
        start = req.run_start_time if req.run_start_time is not None else float("inf")
        return req.slo.tbt_s, (-start, req.arrival_time)

    def running_merge_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (-vlt(req, now, self.params), req.arrival_time)

    def plain_fcfs(self, everything_fits: bool) -> bool:
        # LVF step 1: while memory is not short, rotating anyone only costs transfers.
        return everything_fits

    def on_unservable(self, candidate: Request, now: float) -> Unservable:
        # Skip by default: the simulator measured the strict rule blocking new requests
        # behind a large rotary one (docs/sim/README.md). But a new request lagging past
        # hold_vlt holds the line: without this a large prompt waits while later, smaller
        # ones keep taking the free blocks (measured on the real stack: 21 s TTFT with 13
        # blocks free, docs/results/experiment/README.md).
        return Unservable.STOP if self.holds_the_line(candidate, now) else Unservable.SKIP

    def holds_the_line(self, candidate: Request, now: float) -> bool:
        """Must admission stop at this new request so that free blocks gather for it?"""
        hold = self.limits.hold_vlt
        return (hold is not None and candidate.first_token_time is None
                and candidate.state is RequestState.WAITING
                and vlt(candidate, now, self.params) >= hold)

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        v = vlt(victim, now, self.params)
        return v < 0.0 and v < vlt(candidate, now, self.params) - self.limits.vlt_margin
