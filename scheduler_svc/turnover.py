"""How fast seats free up on their own: running requests finishing, per second.

LVF rotates lazily (policy/rotation.py): it preempts a running request for a
candidate only where the candidates would otherwise miss their deadlines waiting for the
seats that finishing requests free. This module measures that rate.
"""

from __future__ import annotations

from collections import deque


class Turnover:
    """Finish times of the last `max_window_s` seconds; `rate` over a window of them.

    Time with no live request does not count: nothing finishes then because nothing runs,
    not because seats free slowly. A window reaches back over idle spells (a server that
    sat idle before a burst knows its rate from before; measured on the real stack, an
    idle spell read as rate 0 and LVF rotated for requests with 9.9 s of a 10 s SLO left).
    """

    def __init__(self, max_window_s: float = 120.0) -> None:
        self.max_window_s = max_window_s
        self._times: deque[float] = deque()
        self._since: float | None = None  # when counting began (the first iteration)
        self._idle: deque[tuple[float, float]] = deque()  # closed idle spells (from, to)
        self._idle_from: float | None = None  # an idle spell still open

    def start(self, now: float) -> None:
        """Requests are live at `now` (idempotent): counting begins, or an idle spell ends."""
        if self._since is None:
            self._since = now
        elif self._idle_from is not None:
            if now > self._idle_from:
                self._idle.append((self._idle_from, now))
                while self._idle[0][1] < now - 2 * self.max_window_s:
                    self._idle.popleft()
            self._idle_from = None

    def stop(self, now: float) -> None:
        """No request is live from `now` on, until the next `start`."""
        if self._since is not None and self._idle_from is None:
            self._idle_from = now

    def record(self, now: float) -> None:
        """A running request finished at `now`."""
        self._times.append(now)
        cut = now - 2 * self.max_window_s
        while self._times[0] < cut:
            self._times.popleft()

    def rate(self, now: float, window_s: float) -> float:
        """Finishes per second over the last `window_s` seconds with requests live (or
        since counting began, where that is shorter); 0 with no history."""
        if self._since is None:
            return 0.0
        want = min(window_s, self.max_window_s)
        left, cursor = want, now
        if self._idle_from is not None and self._idle_from < now:
            cursor = self._idle_from
        for a, b in reversed(self._idle):
            if b >= cursor:
                cursor = min(cursor, a)
                continue
            if cursor - b >= left:
                break
            left -= cursor - b
            cursor = a
        cut = max(cursor - left, self._since)
        span = want - left + (cursor - cut) if cut < cursor else want - left
        if span <= 0.0:
            return 0.0
        n = 0
        for t in reversed(self._times):
            if t <= cut:
                break
            n += 1
        return n / span
