"""Virtual Lag Time (DESIGN §4): how far a request lags behind its SLOs, one number.

VLT > 0: lagging, serve it first. VLT < 0: ahead, a candidate for preemption.

    waiting, no token yet   (t − arrival)/S_B − (1 − β_B)
    started, not running    λ = (t − first_token − (1 − β_F)·k·S_F) / S_B     (k tokens out)
                            α·λ when lagging (λ ≥ 0), λ/α when ahead
    running                 −(t − run_start) / (α · S_F)

A request that has its first token lags against its *pace*: with k tokens out, its
(k+1)-th is due at `first_token + k·S_F`, the time at which its mean gap so far (TPOT,
the per-request TBT that vLLM's goodput counts) would reach S_F. A request that ran with
iterations shorter than S_F has banked the difference and may be parked that long
without missing its TPOT. One parked past its due time is behind; it is late (`is_late`)
only when it can no longer catch up: served from now on at the measured time between
tokens, its remaining tokens (up to max_tokens) would not bring its mean gap back within
S_F. Where iterations are much shorter than S_F (the CPU stack: 20 ms against 300) a
request behind by many seconds still makes its TPOT; where they take most of S_F (a GPU
under overload) it is late almost at once. β_F is the
share of that budget it may use before it counts as lagging, as β_B is for the TTFT
budget. Both lags are in units of the request's TTFT budget S_B, so that a parked
request's slack and a new request's slack compare in the same seconds. α weighs a started
request against a new one: its lag counts α times, its lead 1/α times, so a larger α makes
it more urgent at every moment (and a running request a later victim).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.request import Request, RequestState


@dataclass(slots=True, frozen=True)
class VLTParams:
    alpha: float = 0.3  # weight of a started request's lag against a new one's (module doc)
    beta_b: float = 0.0  # TTFT tolerance: lag starts after (1 - beta_b) of the TTFT budget
    beta_f: float = 0.0  # TBT tolerance: lag starts after (1 - beta_f) of the TPOT budget

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
        for name in ("beta_b", "beta_f"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


def tokens_out(req: Request) -> int:
    """Output tokens the request has, those whose ids are still being sampled included."""
    return len(req.output_token_ids) + req.num_placeholders


def due_time(req: Request) -> float:
    """When a started request's next token is due to keep its mean gap within S_F; for a
    request with no token yet, its TTFT deadline."""
    first = req.first_token_time
    if first is None:
        return req.arrival_time + req.slo.ttft_s
    return first + tokens_out(req) * req.slo.tbt_s


def is_late(req: Request, now: float, gap_s: float | None = None) -> bool:
    """Has the request already missed the SLO it is waiting on: its TTFT (no token yet),
    or its TPOT (a started request behind its pace that cannot catch up, module doc)?
    `gap_s`: the time between tokens it would get when served (None: unknown, so a
    request behind its pace counts as late)."""
    first = req.first_token_time
    if first is None:
        return now > req.arrival_time + req.slo.ttft_s
    k, tbt = tokens_out(req), req.slo.tbt_s
    behind = now - (first + k * tbt)
    if behind <= 0.0:
        return False
    if gap_s is None:
        return True
    return behind > catch_up_limit(req.sampling.max_tokens - k, tbt, gap_s)


def catch_up_limit(remaining: int, tbt_s: float, gap_s: float) -> float:
    """How far behind its pace a started request may be and still count as on time, with
    `remaining` tokens to go, served from now at `gap_s` per token (module doc).

    Its tokens then end at now + remaining·gap_s, and its mean gap is within S_F if that is
    no later than first + (k + remaining - 1)·S_F: it may be remaining·(S_F - gap_s) - S_F
    behind. Winning back a second of lag takes gap_s/(S_F - gap_s) seconds of a seat; where
    that is more than a second (iterations over half the TBT SLO, a GPU under overload),
    the seat is worth more to a new request and a request behind its pace is late at once
    (measured in the simulator: counting such requests on time cost gh200's artifact run
    20 points of TTFT attainment at 20 req/s for 6 of TPOT, docs/sim/issue18)."""
    win = tbt_s - gap_s
    if win <= gap_s:
        return 0.0
    return remaining * win - tbt_s


def vlt(req: Request, now: float, p: VLTParams) -> float:
    """The request's Virtual Lag Time at `now`, using the request's own SLOs."""
    slo = req.slo
    if req.state is RequestState.RUNNING:
        start = req.run_start_time if req.run_start_time is not None else now
        return -(now - start) / (p.alpha * slo.tbt_s)
    first = req.first_token_time
    if first is None:
        # No token yet: lag against the TTFT budget since arrival.
        return (now - req.arrival_time) / slo.ttft_s - (1.0 - p.beta_b)
    # Rotary (or recomputing after a preemption): lag against its pace (module doc).
    lag = (now - lag_anchor(req, p)) / slo.ttft_s
    return p.alpha * lag if lag >= 0.0 else lag / p.alpha


def lag_anchor(req: Request, p: VLTParams) -> float:
    """When a request starts to lag (VLT 0); its VLT grows linearly from there."""
    first = req.first_token_time
    if first is None:
        return req.arrival_time + (1.0 - p.beta_b) * req.slo.ttft_s
    return first + (1.0 - p.beta_f) * tokens_out(req) * req.slo.tbt_s
