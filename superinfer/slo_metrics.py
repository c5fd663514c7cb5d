"""SLO metrics of a served trace, as DESIGN 8 defines them (shared by sim and bench serve).

* TTFT of a request = first token time - arrival time. TTFT attainment = share of requests
  with TTFT <= their S_B; a request that never got a token counts as a miss.
* TBT = every gap between consecutive tokens of a request, pooled over all requests.
  TBT attainment = share of gaps <= the request's S_F.
* Goodput = requests meeting both (TTFT <= S_B and every gap <= S_F) per second of trace
  duration (the arrival window, e.g. 120 s), as `vllm bench serve --goodput` counts them.
* Throughput = output tokens per second from the first arrival to the last token.
* Not in DESIGN 8, reported beside it: TPOT attainment, the share of requests (with two or
  more tokens) whose *mean* gap, (last token - first token) / (tokens - 1), is <= S_F. That
  is the per-request TBT that DistServe-style papers and `vllm bench serve` (TPOT) use;
  a request paused once for seconds misses it, while it costs only one gap of many in
  TBT attainment.
* Percentiles are numpy's (linear interpolation) over the requests that got a token (TTFT)
  and over all gaps (TBT).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from scheduler_svc.request import Request


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    token_times: list[float]  # when each output token reached the client (or the scheduler)
    ttft_slo_s: float
    tbt_slo_s: float
    prompt_tokens: int = 0
    rotations: int = 0
    finished: bool = True

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def meets_slo(self) -> bool:
        ttft = self.ttft_s
        if ttft is None or ttft > self.ttft_slo_s or not self.finished:
            return False
        return all(g <= self.tbt_slo_s for g in self.gaps())

    def tpot_s(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @classmethod
    def from_request(cls, req: Request) -> RequestRecord:
        return cls(
            request_id=req.request_id,
            arrival_s=req.arrival_time,
            token_times=list(req.token_times),
            ttft_slo_s=req.slo.ttft_s,
            tbt_slo_s=req.slo.tbt_s,
            prompt_tokens=req.num_prompt_tokens,
            rotations=req.num_rotations,
            finished=req.is_finished,
        )


@dataclass(slots=True)
class SLOMetrics:
    requests: int
    completed: int
    ttft_attainment: float
    tbt_attainment: float
    p50_ttft_s: float
    p99_ttft_s: float
    p50_tbt_s: float
    p99_tbt_s: float
    goodput_rps: float
    throughput_tok_s: float
    rotations: int
    # TBT attainment of the gaps of requests rotated out at least once (DESIGN 4, beta_B).
    tbt_attainment_rotated: float = math.nan
    tpot_attainment: float = math.nan
    p99_tpot_s: float = math.nan
    mean_ttft_s: float = math.nan
    # What per-gap TBT attainment hides: the longest gap, and the summed length of every gap
    # over its SLO (a request parked for 70 s is one missed gap, and 70 stall-seconds).
    max_gap_s: float = math.nan
    stall_s: float = 0.0
    output_tokens: int = 0
    duration_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-safe: NaN (no data) becomes None."""
        out = asdict(self)
        for k, v in list(out.items()):
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def compute_metrics(records: Iterable[RequestRecord], duration_s: float | None = None) -> SLOMetrics:
    recs = list(records)
    ttfts = [t for r in recs if (t := r.ttft_s) is not None]
    ttft_ok = sum(1 for r in recs if (t := r.ttft_s) is not None and t <= r.ttft_slo_s)
    gaps_all: list[float] = []
    tbt_ok = 0
    rot_gaps = rot_ok = 0
    stall = 0.0
    for r in recs:
        g = r.gaps()
        ok = sum(1 for x in g if x <= r.tbt_slo_s)
        stall += sum(x for x in g if x > r.tbt_slo_s)
        gaps_all.extend(g)
        tbt_ok += ok
        if r.rotations:
            rot_gaps += len(g)
            rot_ok += ok
    tpots = [(t, r.tbt_slo_s) for r in recs if (t := r.tpot_s()) is not None]
    good = sum(1 for r in recs if r.meets_slo())
    if duration_s is None:
        arrivals = [r.arrival_s for r in recs]
        duration_s = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    out_tokens = sum(len(r.token_times) for r in recs)
    last = max((r.token_times[-1] for r in recs if r.token_times), default=math.nan)
    first = min((r.arrival_s for r in recs), default=math.nan)
    makespan = last - first
    n = len(recs)
    return SLOMetrics(
        requests=n,
        completed=sum(1 for r in recs if r.finished),
        ttft_attainment=ttft_ok / n if n else math.nan,
        tbt_attainment=tbt_ok / len(gaps_all) if gaps_all else math.nan,
        p50_ttft_s=_pct(ttfts, 50),
        p99_ttft_s=_pct(ttfts, 99),
        p50_tbt_s=_pct(gaps_all, 50),
        p99_tbt_s=_pct(gaps_all, 99),
        goodput_rps=good / duration_s if duration_s > 0 else math.nan,
        throughput_tok_s=out_tokens / makespan if makespan > 0 else math.nan,
        rotations=sum(r.rotations for r in recs),
        tbt_attainment_rotated=rot_ok / rot_gaps if rot_gaps else math.nan,
        tpot_attainment=sum(t <= slo for t, slo in tpots) / len(tpots) if tpots else math.nan,
        p99_tpot_s=_pct([t for t, _ in tpots], 99),
        mean_ttft_s=float(np.mean(ttfts)) if ttfts else math.nan,
        max_gap_s=max(gaps_all) if gaps_all else math.nan,
        stall_s=stall,
        output_tokens=out_tokens,
        duration_s=duration_s,
    )
