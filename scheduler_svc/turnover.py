"""How fast seats free up on their own: running requests finishing, per second.

LVF rotates lazily (Scheduler._rotation_needed): it preempts a running request for a
candidate only where the candidates would otherwise miss their deadlines waiting for the
seats that finishing requests free. This module measures that rate.
"""

from __future__ import annotations

from collections import deque


class Turnover:
    """Finish times of the last `max_window_s` seconds; `rate` over a window of them."""

    def __init__(self, max_window_s: float = 120.0) -> None:
        self.max_window_s = max_window_s
        self._times: deque[float] = deque()
        self._since: float | None = None  # when counting began (the first iteration)

    def start(self, now: float) -> None:
        """Counting begins (idempotent): a rate over less history uses the time since."""
        if self._since is None:
            self._since = now

    def record(self, now: float) -> None:
        """A running request finished at `now`."""
        self._times.append(now)
        cut = now - self.max_window_s
        while self._times[0] < cut:
            self._times.popleft()

    def rate(self, now: float, window_s: float) -> float:
        """Finishes per second in (now - window_s, now] (or since counting began, where
        that is shorter); 0 with no history."""
        if self._since is None:
            return 0.0
        span = min(window_s, self.max_window_s, now - self._since)
        if span <= 0.0:
            return 0.0
        cut = now - span
        n = 0
        for t in reversed(self._times):
            if t <= cut:
                break
            n += 1
        return n / span
