"""LVF's minimum residency, adapted online to the new requests that are already late
(`RotationLimits.adapt_residency`; off: measured not to pay, below).

A request LVF (re)admits is safe from proactive rotation for a number of iterations, so
that a rotation is not undone a batch later (thrash: every rotation is a missed gap and a
stay parked). How long pays depends on the load, which no fixed number follows. Measured
in the simulator on a rate step (1x -> 2x -> 1x capacity, docs/results/rotasched/): at 1x
every value from 0 to 128 iterations ties on attainment and a longer residency only
saves rotations and missed gaps; at 2x a shorter one wins 4.5-5.6 points of joint
attainment (0 against 32), because the requests that miss are new ones that residency
keeps from a seat, and 128 loses 6-11 points.

So the residency follows the waiting requests that are already late (past the point
where they can make their TTFT SLO, `vlt.is_late`), as a share of the running batch:
the full `RotationLimits.min_residency` (32 iterations) up to `LOW_PRESSURE`, none from
`FULL_PRESSURE`, linear between. It is off: on the rate step it wins 1.6 of the 5 points at 2x (14 -> 28 req/s), and
where lowering the residency does not pay it still fires: Llama-3-8B at 100 req/s (the
artifact's flags) rotated 2.4 times as often, TTFT 96.4 -> 94.2 % and per-gap TBT 99.3 ->
98.3 %. Signals that were tried and not kept (same page): late
first tokens come too late (at 2x the first ones 30 s into the overload, a point of the
five won); slow first tokens (over half the TTFT SLO) come early but also under a light
overload that LVF already serves, where the extra rotations cost per-gap TBT beyond the
noise (the paper's artifact at 20 req/s: 99.3 -> 97.6 %).
"""

from __future__ import annotations

import math

LOW_PRESSURE = 0.02  # late waiting requests per running one that leave the full residency
FULL_PRESSURE = 0.1  # ... and that leave none


class AdaptiveResidency:
    def __init__(self, ceiling: int, low: float = LOW_PRESSURE,
                 full: float = FULL_PRESSURE) -> None:
        self.ceiling = ceiling
        self._low, self._full = low, full
        self.iterations = ceiling  # the residency the last count gave

    def count_limit(self, running: int) -> int:
        """How many late waiting requests are worth counting: past this, none is left."""
        return math.ceil(self._full * max(1, running)) + 1

    def update(self, late_waiting: int, running: int) -> int:
        share = late_waiting / max(1, running)
        pressure = (share - self._low) / (self._full - self._low)
        self.iterations = round(self.ceiling * min(1.0, max(0.0, 1.0 - pressure)))
        return self.iterations
