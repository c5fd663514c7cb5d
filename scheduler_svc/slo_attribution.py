"""Where the time of SLO misses went, as histograms the scheduler exports on /metrics.

Each request carries its own attribution (scheduler_svc/request.py, PHASES): the seconds
of its TTFT interval, and of its gaps longer than S_F, spent waiting, rotary, computing
and stalled on transfers. When it finishes, a request that missed its TTFT SLO adds one
observation per phase to the `ttft` histograms, and one that missed any gap adds the
phases of its missed gaps to the `tbt` histograms.

GetStats carries statistics as a flat map of numbers, so a histogram travels as keys
`<key>:bucket:<le>` (cumulative counts, Prometheus' convention, `+Inf` last), `<key>:sum`
and `<key>:count`; the gateway (gateway/metrics.py) puts them back together.
"""

from __future__ import annotations

import bisect
import math

from scheduler_svc.request import PHASES, Request

# Seconds: from a few iterations to a request parked for minutes.
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
SLOS = ("ttft", "tbt")


def histogram_key(slo: str, phase: str) -> str:
    return f"slo_miss_{slo}_{phase}_s"


HISTOGRAM_KEYS = tuple(histogram_key(s, p) for s in SLOS for p in PHASES)


def base_key(flat_key: str) -> str:
    """The statistic a flattened key belongs to (`x:bucket:0.5` -> `x`)."""
    return flat_key.split(":", 1)[0]


class Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # per bucket, +Inf last
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value
        self.count += 1

    def flat(self, key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        total = 0
        for le, n in zip([*BUCKETS, math.inf], self.counts, strict=True):
            total += n
            out[f"{key}:bucket:{'+Inf' if math.isinf(le) else le}"] = float(total)
        out[f"{key}:sum"] = self.sum
        out[f"{key}:count"] = float(self.count)
        return out


class MissHistograms:
    """Per (SLO, phase): seconds of the missed intervals of each finished request."""

    def __init__(self) -> None:
        self.hist = {k: Histogram() for k in HISTOGRAM_KEYS}

    def observe(self, req: Request, ttft_missed: bool, now: float) -> None:
        if ttft_missed:
            phases = req.ttft_phases or req.open_phases(now)
            for phase in PHASES:
                self.hist[histogram_key("ttft", phase)].observe(phases.get(phase, 0.0))
        if req.num_missed_gaps:
            for phase in PHASES:
                self.hist[histogram_key("tbt", phase)].observe(
                    req.missed_gap_phases.get(phase, 0.0))

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, h in self.hist.items():
            out.update(h.flat(key))
        return out
