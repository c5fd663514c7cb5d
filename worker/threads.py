"""How many threads a step runs on, chosen by measuring steps, not assumed.

On 2 shared cores the best count flips with the load around the worker: measured here,
2 threads are ~1.6x faster than 1 on a quiet machine, and 1 thread is faster (up to 100x
at worst) once another process holds a core, because OpenMP barriers then wait for a
descheduled thread. Per bucket of step sizes (tokens per step) the tuner exploits the
count with the lowest lower-quartile of its recent step times; once the time spent
exploiting reaches `budget` times what the last exploration cost, it explores another
count for `trial` steps (the first of which is not counted: it pays the threads' wake-up;
a step `abort` times slower than the best ends the trial at once). So exploring costs at
most ~1/budget of the run.

It must run on the thread that executes the steps: OpenMP's thread count is a per-thread
setting (worker/batches.py runs every batch on one thread).
"""

from __future__ import annotations

import torch

BUCKETS = (1, 4, 16, 64, 256)  # upper bounds of tokens per step


def default_choices(max_threads: int) -> tuple[int, ...]:
    """1, half and all of the threads torch was given (one choice: the tuner is off)."""
    return tuple(sorted({1, max(1, max_threads // 2), max(1, max_threads)}))


class ThreadTuner:
    def __init__(self, choices: tuple[int, ...], budget: float = 20.0, trial: int = 4,
                 keep: int = 8, abort: float = 3.0) -> None:
        if not choices or min(choices) < 1:
            raise ValueError(f"thread choices must be positive counts, got {choices}")
        self.choices = choices
        self.budget = budget
        self.trial = trial
        self.keep = keep
        self.abort = abort
        self.hist: dict[tuple[int, int], list[float]] = {}  # (bucket, threads) -> seconds
        self.since: dict[int, float] = {}  # exploiting seconds since the last exploration
        self.cost: dict[int, float] = {}  # seconds the last exploration took
        self.plan: dict[int, list[int]] = {}  # the remaining steps of an exploration
        self.nexp: dict[int, int] = {}
        self._b = 0
        self._t = choices[-1]
        self._counted = True
        self._exploring = False

    @property
    def enabled(self) -> bool:
        return len(self.choices) > 1

    def _quartile(self, key: tuple[int, int]) -> float:
        # the lower quartile: robust to the one-off spikes a shared machine adds
        h = sorted(self.hist.get(key, []))
        return h[(len(h) - 1) // 4] if h else float("inf")

    def best(self, bucket: int) -> int:
        return min(self.choices, key=lambda c: self._quartile((bucket, c)))

    def begin(self, num_tokens: int) -> None:
        """Before a step of `num_tokens` tokens: set the thread count to run it with."""
        if not self.enabled:
            return
        b = next((i for i, lim in enumerate(BUCKETS) if num_tokens <= lim), len(BUCKETS))
        plan = self.plan.setdefault(b, [])
        fresh = [c for c in self.choices if (b, c) not in self.hist]
        if not plan and fresh:  # first visits: try every choice, no budget
            plan.extend([fresh[0]] * self.trial)
            self.hist[(b, fresh[0])] = []
            self.nexp[b] = len(self.choices)
        elif not plan and self.since.get(b, 0.0) >= self.budget * self.cost.get(b, 0.0):
            i = self.nexp.get(b, 0)  # round robin over the choices, skipping the best
            self.nexp[b] = i + 1
            c = self.choices[i % len(self.choices)]
            if c == self.best(b):
                c = self.choices[(i + 1) % len(self.choices)]
                self.nexp[b] = i + 2
            plan.extend([c] * self.trial)
            self.hist[(b, c)] = []
            self.cost[b] = 0.0
        self._exploring = bool(plan)
        t = plan.pop(0) if plan else self.best(b)
        self._counted = t == torch.get_num_threads()
        self._b, self._t = b, t
        if not self._counted:
            torch.set_num_threads(t)

    def end(self, seconds: float) -> None:
        """After the step: it took `seconds`."""
        if not self.enabled:
            return
        b = self._b
        if self._exploring:
            self.cost[b] = self.cost.get(b, 0.0) + seconds
            others = [self._quartile((b, c)) for c in self.choices if c != self._t]
            if others and seconds > self.abort * min(others):
                self.plan[b] = []  # a hopeless trial (spinning threads beside a hog): stop
                self.hist.setdefault((b, self._t), []).append(seconds)
            if not self.plan.get(b):
                self.since[b] = 0.0
        else:
            self.since[b] = self.since.get(b, 0.0) + seconds
        if self._counted:
            h = self.hist.setdefault((b, self._t), [])
            h.append(seconds)
            del h[: -self.keep]

    def state(self) -> dict[str, float]:
        """Lower-quartile step time (ms) per bucket and thread count."""
        return {f"b{b}/t{t}": self._quartile((b, t)) * 1e3 for (b, t) in sorted(self.hist)}
