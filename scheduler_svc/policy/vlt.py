"""Virtual Lag Time (DESIGN §4): how far a request lags behind its SLOs, one number.

VLT > 0: lagging, serve it first. VLT < 0: ahead, a candidate for preemption.

    waiting, no token yet      (t − arrival)/S_B − (1 − β_B)
    started (running or not)   λ = (t − min(D − β_F·k·S_F, P)) / S_B
                               (k tokens out, D = deadline; P = last token + m·S_B
                               while parked, ∞ while running: the stall bound)
                               α·λ when lagging (λ ≥ 0), λ/α when ahead
    running, prefilling        −(t − run_start) / (α · S_F)

A started request lags against its *deadline* D: the latest time its next token may come
and its TPOT (its mean gap, which vLLM's goodput counts) still be met. With k tokens out,
its (k+1)-th is due at `first_token + k·S_F`; served from then on at the measured time
between tokens τ, it also wins back S_F − τ per remaining token (`catch_up_limit`, within
the tokens it counts on, `tokens_left`), or a share of it where τ > S_F/2. A request past
D is late (`is_late`): it can no longer make its TPOT. So running, parked and new
requests compare by the same slack, in seconds: lags are in units of the longest live
TTFT SLO (`unit_s`), so that requests of different SLO classes order by their slack. α
weighs a started request against a new one (its lag counts α times, its lead 1/α times;
the default 1 orders every live request by its slack). `max_stall` bounds how long a
parked, streaming request's slack counts (`stall_anchor`); off by default. The
measurements behind each choice: docs/results/rotasched/ ("The VLT definition").
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.request import Request, RequestState


@dataclass(slots=True, frozen=True)
class VLTParams:
    alpha: float = 1.0  # weight of a started request's lag against a new one's (module doc)
    beta_b: float = 0.0  # TTFT tolerance: lag starts after (1 - beta_b) of the TTFT budget
    beta_f: float = 0.0  # TBT tolerance: lag starts after (1 - beta_f) of the TPOT budget
    # A parked started request lags at the latest this share of its TTFT SLO after its
    # last token, however far its deadline lies (module doc; None: no bound).
    max_stall: float | None = None

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
        if self.max_stall is not None and not self.max_stall > 0.0:
            raise ValueError(f"max_stall must be positive (None: no bound), got {self.max_stall}")
        for name in ("beta_b", "beta_f"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")


def tokens_out(req: Request) -> int:
    """Output tokens the request has, those whose ids are still being sampled included."""
    return len(req.output_token_ids) + req.num_placeholders


FIRST_TOKEN_BATCHES = 2  # a new request's first token: the batch in flight, then its own


class OutputLengths:
    """The output lengths of the last `window` finished requests, for what a request whose
    length is not known may count on (`tokens_left`). `view()` is a sorted snapshot: the
    policy takes a new one only when it re-files its queues, so that the deadlines a lazy
    order was sorted by stay put in between."""

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self._window = window
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []
        self.added = 0  # lengths observed so far

    def observe(self, n: int) -> None:
        bisect.insort(self._sorted, n)
        self._fifo.append(n)
        if len(self._fifo) > self._window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self.added += 1

    def view(self) -> tuple[int, ...]:
        return tuple(self._sorted)


# Where a request's output length is not known, the share of finished requests longer than
# it that went on to produce fewer tokens than it counts on (tokens_left): it counts on
# their 10th percentile.
COUNT_ON_QUANTILE = 0.1


def tokens_left(req: Request, k: int, lengths: Sequence[int] | None = None) -> int:
    """The output tokens a started request with `k` out counts on still producing.

    Known length (`Request.length_known`, a benchmark's ignore_eos requests), or `lengths`
    None: max_tokens - k. Else max_tokens only bounds it (an OpenAI request without
    max_tokens is bounded by the whole context), and it counts on what nine in ten of the
    finished requests longer than k went on to produce after their k-th token (`lengths`:
    the finished requests' output lengths, sorted; COUNT_ON_QUANTILE), at most
    max_tokens - k; nothing when none was longer.

    The order (its slack, `vlt`) counts on that; whether it is late (`is_late`) counts on
    max_tokens: a request is parked only against a catch-up it will most likely have the
    tokens for, and given up on only when not even its bound would bring it back. Measured
    with the requests' lengths unknown to the scheduler (docs/results/rotasched/): counting on max_tokens - k for both, LVF parked requests for catch-ups they
    never had the tokens for (the CPU stack's twin, 40 seeds at 1.5x and 2x saturation:
    TPOT 76.6 and 58.2 %, the real-stack claim on 6 and 5 seeds; gh200-96gb at 17 and 20
    req/s: TPOT 67.2 and 52.2 %, goodput 7.27 and 5.73 req/s); counting on the median for
    both, it gave up on requests that would have made it (96gb: 61.9 and 36.9 %, 6.58 and
    3.81). This split: the twin's claim on 32 and 40 seeds (34 and 40 with the lengths
    known), 96gb 90.9 / 92.3 % TPOT at 7.73 and 7.25 req/s."""
    left = req.sampling.max_tokens - k
    if lengths is None or req.length_known:
        return left
    i = bisect.bisect_right(lengths, k)
    longer = len(lengths) - i
    if longer <= 0:
        return 0
    return min(left, lengths[i + int(COUNT_ON_QUANTILE * (longer - 1))] - k)


def due_time(req: Request) -> float:
    """When a started request's next token is due to keep its mean gap within S_F; for a
    request with no token yet, its TTFT deadline."""
    first = req.first_token_time
    if first is None:
        return req.arrival_time + req.slo.ttft_s
    return first + tokens_out(req) * req.slo.tbt_s


def deadline(req: Request, gap_s: float | None = None,
             lengths: Sequence[int] | None = None) -> float:
    """The latest time the request may be served from (admitted, or resumed) and still meet
    the SLO it waits on, when served at `gap_s` per token (None: unknown, taken as 0).

    No token yet: its TTFT deadline less two batches, since its first token comes up to two
    batches after it is admitted (pipelined: the batch in flight, then its own). Measured
    in the simulator (docs/results/rotasched/, Llama-3-8B at 140 req/s, where a batch is
    0.8 of S_F): counting it late only past the TTFT deadline itself kept admitting the
    requests just short of it, whose first tokens then came just after it (p50 TTFT 5.15 s
    against 5 s): TTFT 17.7 %, goodput 6.56 req/s; less one batch, 23.2 % and 8.86; less
    two, 66.4 % and 22.18 (TPOT 69.9 → 61.5 %). A started request: its due time,
    pushed back by the lag it can still win back within its remaining tokens
    (`catch_up_limit`, which already counts the batch its next token takes), within the
    tokens it counts on (`tokens_left`; `lengths` as there: None, its bound)."""
    due = due_time(req)
    if gap_s is None:
        return due
    if req.first_token_time is None:
        return due - FIRST_TOKEN_BATCHES * gap_s
    k, tbt = tokens_out(req), req.slo.tbt_s
    extra = catch_up_limit(tokens_left(req, k, lengths), tbt, gap_s)
    return due + extra if extra > 0.0 else due


def is_late(req: Request, now: float, gap_s: float | None = None) -> bool:
    """Has the request already missed the SLO it is waiting on: its TTFT (no token yet),
    or its TPOT (a started request behind its pace that cannot catch up even if it runs
    to its max_tokens, module doc)? `gap_s`: the time between tokens it would get when
    served (None: unknown, so a request behind its pace counts as late)."""
    return now > deadline(req, gap_s)


def catch_up_limit(remaining: int, tbt_s: float, gap_s: float) -> float:
    """How far behind its pace a started request may be and still count as on time, with
    `remaining` tokens to go, served from now at `gap_s` per token (module doc).

    Its tokens then end at now + remaining·gap_s, and its mean gap is within S_F if that is
    no later than first + (k + remaining - 1)·S_F: it could be remaining·(S_F - gap_s) - S_F
    behind. But winning back a second of lag takes gap_s/(S_F - gap_s) seconds of a seat;
    where that is more than a second (iterations over half the TBT SLO, a GPU under
    overload) the seat is worth more to others, so only that exchange rate's share of the
    lag counts as recoverable: all of it at gap_s ≤ S_F/2, none as gap_s nears S_F.
    Measured in the simulator (docs/results/rotasched/), TTFT / TPOT %:
    counting none of it above S_F/2 (the rule until then) made requests late en masse
    whenever the batch time crossed S_F/2 (gh200-96gb at 20 req/s: 100 / 81.1; Mixtral at
    60: 83.1 / 64.5); counting all of it made Llama-3-8B at 100 req/s (gap_s ≈ 0.9·S_F)
    fall from 81.4 / 65.2 to 71.0 / 54.8. The share: 100 / 83.6, 98.3 / 79.3, 95.6 / 76.6."""
    win = tbt_s - gap_s
    if win <= 0.0:
        return 0.0
    limit = remaining * win - tbt_s
    return limit if win >= gap_s else limit * win / gap_s


def vlt(req: Request, now: float, p: VLTParams, gap_s: float | None = None,
        unit_s: float | None = None, lengths: Sequence[int] | None = None) -> float:
    """The request's Virtual Lag Time at `now`, using the request's own SLOs; `gap_s` and
    `lengths` as for `deadline`. Lags count in units of `unit_s` seconds (None: the
    request's own TTFT SLO; module doc)."""
    slo = req.slo
    first = req.first_token_time
    if first is None:
        if req.state is RequestState.RUNNING:  # its prompt is being prefilled
            start = req.run_start_time if req.run_start_time is not None else now
            return -(now - start) / (p.alpha * slo.tbt_s)
        # No token yet: lag against the TTFT budget since arrival.
        v = (now - req.arrival_time) / slo.ttft_s - (1.0 - p.beta_b)
    else:
        # Started, running or not: lag against its deadline (module doc).
        lag = (now - lag_anchor(req, p, gap_s, lengths)) / slo.ttft_s
        v = p.alpha * lag if lag >= 0.0 else lag / p.alpha
    return v if unit_s is None else v * (slo.ttft_s / unit_s)


def lag_anchor(req: Request, p: VLTParams, gap_s: float | None = None,
               lengths: Sequence[int] | None = None) -> float:
    """When a request starts to lag (VLT 0); its VLT grows linearly from there."""
    first = req.first_token_time
    if first is None:
        return req.arrival_time + (1.0 - p.beta_b) * req.slo.ttft_s
    anchor = deadline(req, gap_s, lengths) - p.beta_f * tokens_out(req) * req.slo.tbt_s
    return min(anchor, stall_anchor(req, p))


def stall_anchor(req: Request, p: VLTParams) -> float:
    """When a parked started request has waited `max_stall` of its TTFT SLO since its last
    token (module doc); infinity for one running, one with no token, or with no bound."""
    last, cap = req.last_token_time, p.max_stall
    if cap is None or last is None or req.state is RequestState.RUNNING:
        return math.inf
    return last + cap * req.slo.ttft_s
