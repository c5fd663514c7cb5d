"""Virtual Lag Time (DESIGN §4): how far a request lags behind its SLOs, one number.

VLT > 0: lagging, serve it first. VLT < 0: ahead, a candidate for preemption.

    waiting, no token yet      (t − arrival)/S_B − (1 − β_B)
    started (running or not)   λ = (t − min(D − β_F·k·S_F, P)) / S_B
                               (k tokens out, D = deadline; P = last token + m·S_B
                               while parked, ∞ while running: the stall bound)
                               α·λ when lagging (λ ≥ 0), λ/α when ahead
    running, prefilling        −(t − run_start) / (α · S_F)

A started request lags against its *deadline* D: the latest time its next token may come
and its TPOT (its mean gap, the per-request TBT that vLLM's goodput counts) still be met.
With k tokens out, its (k+1)-th is due at `first_token + k·S_F` (its pace); a request that
ran with iterations shorter than S_F has banked the difference. Served from then on at the
measured time between tokens τ, it also wins back S_F − τ per remaining token, so D is
its due time plus that (`catch_up_limit`, within the tokens it counts on, `tokens_left`:
max_tokens where nothing else can end it; else, for its order, what nine in ten finished
requests longer than it went on to produce, and for whether it is late, max_tokens), or
a share of it where τ > S_F/2 (catching up then costs more seat time than it wins). A
request past D is late (`is_late`): it can no longer make its TPOT. Where iterations are
much shorter than S_F (the CPU stack: 20 ms against 300) D lies seconds past the due
time; as they near S_F (a GPU under overload) D nears the due time. While a request
runs, each token moves D by τ (catch-up) or S_F (pace) as time moves by τ: its lead
holds or grows; parked, it shrinks second for second.
So running and parked requests, and new ones, compare by the same slack: victims are the
requests furthest ahead of their deadlines (measured: LVF ranked running requests by time
since admission instead and rotated a request out after a batch or two however far
behind it was; docs/results/rotasched/). β_F is the share of the TPOT budget a request may use
before it counts as lagging, as β_B is for the TTFT budget. Both lags are in units of the
request's TTFT budget S_B, so that a parked request's slack and a new request's slack
compare in the same seconds. Where live requests carry different SLOs, the unit is one
for all of them (`unit_s`: the longest live TTFT SLO, set by the scheduler), so that VLT
orders requests of different classes by their slack in seconds: in a request's own S_B,
a batch-class request 13 s from its 20 s TTFT deadline outranked an interactive one 0.6 s
from its 1 s deadline, which then missed it (measured, docs/results/rotasched/). With
one class the two are the same. α weighs a started request against a new one: its lag counts
α times, its lead 1/α times, so a larger α makes it more urgent at every moment (and a
running request a later victim). The default, 1, orders every live request by its slack
in seconds. It was 0.3, which sent new requests first while a parked one still had slack
and let it sit out parks that used all of it; measured against it (docs/results/rotasched/): the simulator's goodput summed over the 26 must-show cells
+1.9 % and +2.0 % (seeds 0, 1), TPOT up in every cell that fails on it, Llama-3-8B at
140 req/s passing, the mixed artifact cell's interactive TTFT down 0.5 points (now under
waiting-first's); on the CPU stack's twin the real-stack claim held on 34 of 40 seeds at
1.5x saturation (0.3: 25), and on the real stack the longest stall fell from 19-26 s to
12-16 s with more requests meeting both SLOs on each of four seeds.

A parked request's deadline can lie far ahead, and a streaming user sees the wait for
it: on the CPU stack the catch-up allowance let a request 16 tokens into 64 sit out 16 s
and still meet its TPOT, which per-gap TBT counts as one miss and vLLM's goodput as good
(docs/results/rotasched/). With `max_stall` = m a parked request's slack counts only
until m·S_B after its last token (`stall_anchor`): it lags from then on, and before then
it outranks a new request once its slack is under α times the new one's (with α 1 and
m 0.25, at once against one just arrived). Only its rank moves: whether it is late still
follows D alone, so the bound never makes a request late (late ones are served last).
It is off by default. On the CPU stack (m 0.25, 1.5x and 2x) it cut the longest stall
from 17 s to 3-3.5 s at 100 % TTFT, with twice the rotations and per-gap misses:
swapped-first then beat LVF on per-gap TBT and goodput (docs/results/rotasched/).
Under sustained overload on a GPU it costs more than it bounds: the simulator, gh200-96gb
at 24 req/s, TTFT / TPOT % and goodput: off 100 / 91.1, 9.50 req/s (longest gap 103 s);
m 0.25: 73.7 / 99.5, 7.69 (48 s); m 1: 98.5 / 69.9, 7.29; m 2: 99.5 / 79.9, 8.29, with
2-3.6x the rotations: every stalled request that takes a seat leaves it to a new one that
then rotates someone else out (docs/results/rotasched/).
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
