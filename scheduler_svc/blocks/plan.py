"""The iteration's transfer plan while it is built, and the blocks its copies touch."""

from __future__ import annotations

from common.contracts import TransferPlan


class IterationPlan:
    """The open plan (between begin_iteration and end_iteration) and its fence counter.

    Every plan's copies are complete before the next plan is made (the engine step awaits
    them), so the rules that keep copies race-free only have to hold within one plan: the
    sets below, cleared when it closes.
    """

    __slots__ = ("plan", "next_fence", "busy", "filling", "host_written", "host_read")

    def __init__(self) -> None:
        self.plan: TransferPlan | None = None
        self.next_fence = 1
        # Device blocks this plan's D2H copies read. One of them handed to compute and
        # released again before the plan closes must not reach the free list: a swap-in of
        # the same plan could get it and write it while the D2H copy still reads it.
        self.busy: set[int] = set()
        # Device blocks its H2D copies fill, host blocks its D2H copies write and host
        # blocks its H2D copies read (see the prefix-caching rules in prefix.py).
        self.filling: set[int] = set()
        self.host_written: set[int] = set()
        self.host_read: set[int] = set()

    def begin(self) -> None:
        self.plan = TransferPlan(fence=self.next_fence)
        self.next_fence += 1

    def close(self) -> TransferPlan | None:
        plan, self.plan = self.plan, None
        self.busy.clear()
        self.filling.clear()
        self.host_written.clear()
        self.host_read.clear()
        return plan

    def get(self) -> TransferPlan:
        """The open plan; block moves outside an iteration are a caller's bug."""
        if self.plan is None:
            raise RuntimeError("block moves need begin_iteration() first")
        return self.plan
