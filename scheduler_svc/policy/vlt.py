"""Virtual Lag Time (DESIGN §4): how far a request lags behind its SLOs, one number.

VLT > 0: lagging, serve it first. VLT < 0: ahead, a candidate for preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.request import Request, RequestState


@dataclass(slots=True, frozen=True)
class VLTParams:
    alpha: float = 3.0  # weight of TBT lag against TTFT lag
    beta_b: float = 0.0  # TTFT tolerance: lag starts after (1 - beta_b) of the TTFT budget
    beta_f: float = 0.5  # TBT tolerance: lag starts after (1 - beta_f) of the TBT budget

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
        for name in ("beta_b", "beta_f"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


def vlt(req: Request, now: float, p: VLTParams) -> float:
    """The request's Virtual Lag Time at `now`, using the request's own SLOs."""
    slo = req.slo
    if req.state is RequestState.RUNNING:
        start = req.run_start_time if req.run_start_time is not None else now
        return -(now - start) / (p.alpha * slo.tbt_s)
    last = req.last_token_time
    if last is None:
        # No token yet: lag against the TTFT budget since arrival.
        return (now - req.arrival_time) / slo.ttft_s - (1.0 - p.beta_b)
    # Rotary (or recomputing after a preemption): lag against the TBT budget since the
    # last token, weighted by alpha.
    return p.alpha * ((now - last) / slo.tbt_s - (1.0 - p.beta_f))
