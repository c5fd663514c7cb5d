"""LVF's minimum residency, adapted online to the misses of first tokens.

A request LVF (re)admits is safe from proactive rotation for a number of iterations, so
that a rotation is not undone a batch later (thrash: every rotation is a missed gap and a
stay parked). How long pays depends on the load, which no fixed number follows. Measured
in the simulator on a rate step (1x -> 2x -> 1x capacity, docs/results/rotasched/): at 1x
every value from 0 to 128 iterations ties on attainment and a longer residency only
saves rotations and missed gaps; at 2x a shorter one wins 4.5-5.6 points of joint
attainment (0 against 32), because the requests that miss are new ones that residency
keeps from a seat, and 128 loses 6-11 points.

So the residency follows what the scheduler sees of first tokens, the leading sign of
overload: a first token that took more than `WAIT_SHARE` of its TTFT SLO counts as slow.
While none of the last `WINDOW` was slow, the residency is the full
`RotationLimits.min_residency` (32 iterations); as their share grows to `FULL_PRESSURE`, it
falls linearly to none. Counting only late first tokens (past the SLO) moved too late:
at 2x the first ones come 30 s into the overload, and adaptation won a point of the five
(docs/results/rotasched/, "The residency adapted online").
"""

from __future__ import annotations

from collections import deque

WAIT_SHARE = 0.5  # a first token that took more than this share of its TTFT SLO counts
WINDOW = 128  # the last first tokens the share is taken over
FULL_PRESSURE = 0.05  # a share of late first tokens at which no residency is left


class AdaptiveResidency:
    def __init__(self, ceiling: int, window: int = WINDOW,
                 full_pressure: float = FULL_PRESSURE) -> None:
        self.ceiling = ceiling
        self._full = full_pressure
        self._late: deque[bool] = deque(maxlen=window)
        self._count = 0  # late ones in the window
        self.iterations = ceiling  # the residency now

    def observe_first_token(self, late: bool) -> None:
        window = self._late
        if len(window) == window.maxlen:
            self._count -= window[0]
        window.append(late)
        self._count += late
        share = self._count / len(window)
        self.iterations = round(self.ceiling * max(0.0, 1.0 - share / self._full))

    @property
    def late_share(self) -> float:
        return self._count / len(self._late) if self._late else 0.0
