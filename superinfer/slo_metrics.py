"""SLO metrics of a served trace, as DESIGN 8 defines them (shared by sim and bench serve).

* TTFT of a request = first token time - arrival time. TTFT attainment = share of requests
  with TTFT <= their S_B; a request that never got a token counts as a miss.
* TBT = every gap between consecutive tokens of a request, pooled over all requests.
  TBT attainment = share of gaps <= the request's S_F.
* Goodput (`goodput_rps`) = completed requests with TTFT <= S_B and TPOT <= S_F, per
  second from the first arrival to the last token: what `vllm bench serve --goodput
  ttft:S_B tpot:S_F` counts (its TPOT of a one-token request is 0; it divides by the
  benchmark's duration). `good_requests` is the count.
* Every-gap goodput (`goodput_every_gap_rps`), stricter: completed requests with TTFT <=
  S_B and *every* gap <= S_F, per second of the arrival window (e.g. 120 s).
* Throughput = output tokens per second from the first arrival to the last token.
* TPOT attainment: the share of requests (with two or more tokens) whose *mean* gap,
  (last token - first token) / (tokens - 1), is <= S_F. That is the per-request TBT that
  DistServe-style papers and `vllm bench serve` (TPOT) use; a request paused once for
  seconds misses it, while it costs only one gap of many in TBT attainment.
* SLO-miss attribution (where the server says the time went; records that carry it):
  `miss_ttft_s` sums, over the requests that missed TTFT, the seconds of their TTFT spent
  in each phase (scheduler_svc.request.PHASES: waiting, rotary, computing, transfer);
  `miss_tbt_s` the same over every gap longer than S_F.
* Per SLO class (records that carry one, `per_class`): the same attainments and goodputs
  over the class's requests.
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
    slo_class: str | None = None
    # SLO-miss attribution from the scheduler (None: not known, e.g. seen by a client).
    ttft_phases: dict[str, float] | None = None
    missed_gap_phases: dict[str, float] | None = None
    tenant: str = ""
    # Of its queued time in the missed intervals, the seconds each tenant held the device
    # (scheduler_svc/policy/shares.py; empty while tenants did not contend).
    blame: dict[str, float] | None = None

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

    def meets_slo_vllm(self) -> bool:
        """vLLM's goodput test: completed, TTFT <= S_B, TPOT <= S_F (0 for one token)."""
        ttft = self.ttft_s
        if ttft is None or ttft > self.ttft_slo_s or not self.finished:
            return False
        tpot = self.tpot_s()
        return tpot is None or tpot <= self.tbt_slo_s

    @classmethod
    def from_request(cls, req: Request, slo_class: str | None = None,
                     now: float | None = None) -> RequestRecord:
        """`now`: when the run ended (the time so far of a request with no token yet)."""
        return cls(
            request_id=req.request_id,
            arrival_s=req.arrival_time,
            token_times=list(req.token_times),
            ttft_slo_s=req.slo.ttft_s,
            tbt_slo_s=req.slo.tbt_s,
            prompt_tokens=req.num_prompt_tokens,
            rotations=req.num_rotations,
            finished=req.is_finished,
            slo_class=slo_class,
            ttft_phases=req.ttft_phases or req.open_phases(now if now is not None
                                                           else req.arrival_time),
            missed_gap_phases=dict(req.missed_gap_phases),
            tenant=req.tenant,
            blame=_blame(req, now),
        )



def _blame(req: Request, now: float | None) -> dict[str, float]:
    """The request's blame; one still without a first token when the run ended, past its
    TTFT SLO, adds the interval it is in."""
    out = dict(req.missed_blame)
    if (not req.is_finished and now is not None and req.first_token_time is None
            and now - req.arrival_time > req.slo.ttft_s):
        for k, v in req.open_blame.items():
            out[k] = out.get(k, 0.0) + v
    return out


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
    goodput_rps: float  # vLLM's: TTFT and TPOT (see the module doc)
    throughput_tok_s: float
    rotations: int
    goodput_every_gap_rps: float = math.nan  # TTFT and every gap
    good_requests: int = 0  # vLLM's test
    # TBT attainment of the gaps of requests rotated out at least once (DESIGN 4, beta_B).
    tbt_attainment_rotated: float = math.nan
    tpot_attainment: float = math.nan
    tpot_attainment_rotated: float = math.nan  # ... of the requests rotated at least once
    p99_tpot_s: float = math.nan
    mean_ttft_s: float = math.nan
    # What per-gap TBT attainment hides: the longest gap, and the summed length of every gap
    # over its SLO (a request parked for 70 s is one missed gap, and 70 stall-seconds).
    max_gap_s: float = math.nan
    stall_s: float = 0.0
    output_tokens: int = 0
    duration_s: float = 0.0
    makespan_s: float = 0.0
    # SLO-miss attribution (module doc): phase -> seconds, and how many missed.
    ttft_missed: int = 0
    miss_ttft_s: dict[str, float] = field(default_factory=dict)
    tbt_missed: int = 0
    miss_tbt_s: dict[str, float] = field(default_factory=dict)
    per_class: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-safe: NaN (no data) becomes None."""
        out = _finite(asdict(self))
        assert isinstance(out, dict)
        return out


def _finite(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


# The per-class figures (SLOMetrics.per_class), a subset of the run's.
CLASS_KEYS = ("requests", "ttft_attainment", "tbt_attainment", "tpot_attainment",
              "goodput_rps", "goodput_every_gap_rps", "p99_ttft_s", "p99_tbt_s")


def compute_metrics(records: Iterable[RequestRecord], duration_s: float | None = None) -> SLOMetrics:
    recs = list(records)
    m = _metrics(recs, duration_s)
    classes = sorted({r.slo_class for r in recs if r.slo_class is not None})
    for name in classes:
        sub = _metrics([r for r in recs if r.slo_class == name], m.duration_s, m.makespan_s)
        d = sub.as_dict()
        m.per_class[name] = {k: d[k] for k in CLASS_KEYS}  # type: ignore[misc]
    return m


def _add(into: dict[str, float], phases: dict[str, float] | None) -> None:
    for k, v in (phases or {}).items():
        into[k] = into.get(k, 0.0) + v


def _metrics(recs: list[RequestRecord], duration_s: float | None,
             makespan_s: float | None = None) -> SLOMetrics:
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
    rot_tpots = [t <= r.tbt_slo_s for r in recs if r.rotations and (t := r.tpot_s()) is not None]
    good_every_gap = sum(1 for r in recs if r.meets_slo())
    good = sum(1 for r in recs if r.meets_slo_vllm())
    if duration_s is None:
        arrivals = [r.arrival_s for r in recs]
        duration_s = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    out_tokens = sum(len(r.token_times) for r in recs)
    last = max((r.token_times[-1] for r in recs if r.token_times), default=math.nan)
    first = min((r.arrival_s for r in recs), default=math.nan)
    makespan = last - first
    # A class's goodput is per second of the whole run, so that the classes' goodputs add up.
    span = makespan if makespan_s is None else makespan_s
    miss_ttft: dict[str, float] = {}
    miss_tbt: dict[str, float] = {}
    ttft_missed = tbt_missed = 0
    for r in recs:
        t = r.ttft_s
        if t is None or t > r.ttft_slo_s:
            ttft_missed += 1
            _add(miss_ttft, r.ttft_phases)
        tbt_missed += sum(1 for x in r.gaps() if x > r.tbt_slo_s)
        _add(miss_tbt, r.missed_gap_phases)
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
        goodput_rps=good / span if span > 0 else math.nan,
        throughput_tok_s=out_tokens / makespan if makespan > 0 else math.nan,
        rotations=sum(r.rotations for r in recs),
        goodput_every_gap_rps=good_every_gap / duration_s if duration_s > 0 else math.nan,
        good_requests=good,
        tbt_attainment_rotated=rot_ok / rot_gaps if rot_gaps else math.nan,
        tpot_attainment=sum(t <= slo for t, slo in tpots) / len(tpots) if tpots else math.nan,
        tpot_attainment_rotated=sum(rot_tpots) / len(rot_tpots) if rot_tpots else math.nan,
        p99_tpot_s=_pct([t for t, _ in tpots], 99),
        mean_ttft_s=float(np.mean(ttfts)) if ttfts else math.nan,
        max_gap_s=max(gaps_all) if gaps_all else math.nan,
        stall_s=stall,
        output_tokens=out_tokens,
        duration_s=duration_s,
        makespan_s=span if math.isfinite(span) else 0.0,
        ttft_missed=ttft_missed,
        miss_ttft_s=miss_ttft,
        tbt_missed=tbt_missed,
        miss_tbt_s=miss_tbt,
    )
