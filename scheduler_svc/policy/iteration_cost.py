"""What an iteration will cost, before it runs: the executor's time for a batch shape.

Iteration-time-aware admission (DESIGN §4) needs to know how long a batch of `tokens`
tokens over `seqs` requests holding `context` tokens of KV will take, because a decode
request's time between tokens is the iteration time. Two sources:

* the executor's measured times (`OnlineIterationCost`): a least-squares fit of
  `t = a + b·tokens + c·context` over the batches that ran, with older batches weighing
  less (forgetting), so it follows a machine whose speed drifts. The service uses it.
* a modelled time: the simulator hands the scheduler its own execution cost model
  (superinfer/sim/cost.py), the oracle the online fit is compared against.

The scheduler keeps a second online fit, of the batches that took at least half the time
target, for the token budget (`Scheduler.near_cost`): an executor's time is not one line
(memory-bound small batches, compute-bound large ones), and a line fitted over every batch,
most of them small decodes, underestimated the large batches a budget plans by 9-26 % in
the simulator (Mixtral-8x7B, docs/results/rotasched/), each overrun a missed gap for
every running request.

`tokens_within(target_s, …)` inverts a cost: the largest batch that stays under a time.
Pure Python, no torch: the scheduler imports it.
"""

from __future__ import annotations

from typing import Protocol


class IterationCost(Protocol):
    def seconds(self, tokens: int, seqs: int, context: int) -> float:
        """Estimated execute time of a batch: `tokens` new tokens over `seqs` requests
        whose KV, these tokens included, is `context` tokens in all."""
        ...

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        """A batch of that shape took `seconds` on the executor."""
        ...

    @property
    def ready(self) -> bool:
        """Whether estimates may be trusted yet (a fit needs a few batches)."""
        ...


def tokens_within(cost: IterationCost, target_s: float, seqs: int, context: int,
                  limit: int) -> int:
    """The most batch tokens (≤ `limit`) whose iteration stays within `target_s`, given
    `seqs` running requests with `context` tokens of KV; each new token adds one token of
    context. 0 when even one token does not fit."""
    if cost.seconds(limit, seqs, context + limit) <= target_s:
        return limit
    lo, hi = 0, limit  # seconds(lo) fits (or lo = 0), seconds(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost.seconds(mid, seqs, context + mid) <= target_s:
            lo = mid
        else:
            hi = mid
    return lo


def seqs_within(cost: IterationCost, target_s: float, context_per_seq: float,
                limit: int, reserve: int = 0) -> int:
    """The most decode requests (one token each, ≤ `limit`) whose iteration, beside
    `reserve` more tokens of prefill, stays within `target_s` when each holds
    `context_per_seq` tokens of KV."""

    def fits(k: int) -> bool:
        return cost.seconds(k + reserve, k, int(k * (context_per_seq + 1)) + reserve) <= target_s

    if fits(limit):
        return limit
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class OnlineIterationCost:
    """`t ≈ a + b·tokens + c·context`, fitted by recursive least squares with forgetting.

    Each observed batch updates the fit in O(1) (a 3×3 inverse kept up to date). The
    forgetting factor `lam` weighs a batch `lam**k` after k more batches: 0.99 remembers
    ~100 batches, so the fit tracks the executor as its speed changes with load.
    """

    __slots__ = ("lam", "min_batches", "n", "w", "p")

    def __init__(self, lam: float = 0.99, min_batches: int = 8, prior: float = 1e6) -> None:
        if not 0.0 < lam <= 1.0:
            raise ValueError(f"forgetting factor must be in (0, 1], got {lam}")
        self.lam = lam
        self.min_batches = min_batches
        self.n = 0
        self.w = [0.0, 0.0, 0.0]  # a, b, c
        # Inverse covariance, scaled per regressor so the prior is uninformative for each.
        self.p = [[prior, 0.0, 0.0], [0.0, prior * 1e-6, 0.0], [0.0, 0.0, prior * 1e-9]]

    @property
    def ready(self) -> bool:
        return self.n >= self.min_batches

    def seconds(self, tokens: int, seqs: int, context: int) -> float:
        a, b, c = self.w
        return a + b * tokens + c * context

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        x = (1.0, float(tokens), float(context))
        p, lam = self.p, self.lam
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        k = [v / denom for v in px]
        err = seconds - sum(self.w[i] * x[i] for i in range(3))
        self.w = [self.w[i] + k[i] * err for i in range(3)]
        xp = [sum(x[i] * p[i][j] for i in range(3)) for j in range(3)]
        self.p = [[(p[i][j] - k[i] * xp[j]) / lam for j in range(3)] for i in range(3)]
        self.n += 1
