"""From what the client saw to the shared result vocabulary (DESIGN 8).

Attainment, goodput and throughput come from `slo_metrics.compute_metrics`, the very
function the simulator uses, over records whose arrival is the moment the request was
sent. Beside them, the latency distributions `vllm bench serve` prints, with its
definitions: TTFT (send -> first token), ITL (gaps between consecutive tokens, pooled;
the same numbers as TBT here), TPOT (per request, (last token - first token) /
(tokens - 1)), E2EL (send -> end of the stream, completed requests only); each as mean,
P50, P90, P99 (numpy's linear percentiles).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from superinfer.bench.report import table
from superinfer.bench.serve.stream import StreamOutcome
from superinfer.bench.server_stats import scheduler_stat
from superinfer.slo_metrics import RequestRecord, compute_metrics
from superinfer.workload import TraceRequest

# The simulator's per-result keys (superinfer/sim/report.py RESULT_KEYS), then its extras.
SIM_KEYS = (
    "ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s", "p99_tbt_s",
    "goodput_rps", "throughput_tok_s", "tbt_attainment_rotated", "tpot_attainment",
    "p99_tpot_s", "mean_ttft_s", "max_gap_s", "stall_s", "requests", "completed",
    "goodput_every_gap_rps", "good_requests", "ttft_missed", "tbt_missed", "per_class",
)
MISS_FAMILY = "superinfer_slo_miss_phase_seconds"
PHASE_NAMES = ("waiting", "rotary", "computing", "transfer")


def server_misses(delta: dict[str, float]) -> dict[str, dict[str, float]]:
    """Where the requests that missed spent the missed time, as the server counted it over
    the pass (/metrics histogram deltas; {} for a server without them): per SLO (ttft:
    their TTFT, tbt: their gaps over S_F), seconds per phase and `requests`."""
    out: dict[str, dict[str, float]] = {}
    for slo in ("ttft", "tbt"):
        phases: dict[str, float] = {}
        count = None
        for phase in PHASE_NAMES:
            labels = f"phase={phase},slo={slo}"
            v = delta.get(f"{MISS_FAMILY}_sum{{{labels}}}")
            if v is not None:
                phases[phase] = v
                count = delta.get(f"{MISS_FAMILY}_count{{{labels}}}", count)
        if phases:
            out[slo] = {**phases, "requests": count or 0.0}
    return out
DISTRIBUTIONS = (("ttft", "TTFT"), ("itl", "ITL (TBT)"), ("tpot", "TPOT"), ("e2el", "E2EL"))


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def latency_distributions(records: Sequence[RequestRecord],
                          outcomes: Sequence[StreamOutcome]) -> dict[str, dict[str, float | None]]:
    ttft = [t for r in records if (t := r.ttft_s) is not None]
    itl = [g for r in records for g in r.gaps()]
    tpot = [t for r in records if (t := r.tpot_s()) is not None]
    e2el = [o.done_at - o.sent_at for o in outcomes if o.ok and o.done_at is not None]
    return {"ttft": _dist(ttft), "itl": _dist(itl), "tpot": _dist(tpot), "e2el": _dist(e2el)}


def result_row(
    *, label: str, rps: float, trace: Sequence[TraceRequest], outcomes: Sequence[StreamOutcome],
    ttft_slo_s: float, tbt_slo_s: float, duration_s: float | None, start: float, end: float,
    server: dict[str, float],
) -> dict[str, Any]:
    """One rate's result: the simulator's keys, the bench's extras, and every request."""
    records = [
        o.record(f"r{o.index}", *((t.slo.ttft_s, t.slo.tbt_s) if t.slo else (ttft_slo_s, tbt_slo_s)),
                 slo_class=t.slo.name if t.slo else None)
        for t, o in zip(trace, outcomes, strict=True)
    ]
    m = compute_metrics(records, duration_s).as_dict()
    row: dict[str, Any] = {"policy": label, "base_policy": None, "rps": rps}
    row.update({k: m[k] for k in SIM_KEYS})
    rotations = scheduler_stat(server, "rotations")
    row["rotations"] = None if rotations is None else int(rotations)
    # The prefix cache, as the client saw it (usage.prompt_tokens_details.cached_tokens)
    # and, where the server has them, per tier from its counters.
    cached = [o.cached_tokens for o in outcomes if o.cached_tokens is not None]
    prompt = sum(o.prompt_tokens or 0 for o in outcomes)
    row["cached_tokens"] = sum(cached) if cached else None
    row["prefix_cache_hit_rate"] = sum(cached) / prompt if cached and prompt else None
    row["server_prefix_cache"] = {
        key: None if (v := scheduler_stat(server, key)) is None else int(v)
        for key in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_host_queries",
                    "prefix_cache_host_hits")
    }
    completed = [o for o in outcomes if o.ok]
    wall = end - start
    row.update({
        "failed": len(outcomes) - len(completed),
        "prompt_tokens": sum(o.prompt_tokens or 0 for o in outcomes),
        "output_tokens": m["output_tokens"],
        "untimed_tokens": sum(o.untimed_tokens for o in outcomes),
        "duration_s": wall,  # first scheduled send -> last stream closed
        "request_throughput_rps": len(completed) / wall if wall > 0 else None,
        "goodput_duration_s": m["duration_s"],
        "max_send_lag_s": max((o.sent_at - start - o.scheduled_s for o in outcomes), default=0.0),
        "latency_s": latency_distributions(records, outcomes),
        "server_misses": server_misses(server),
        "stats": {"server_metrics_delta": server},
        "per_request": [_detail(t, o, start) for t, o in zip(trace, outcomes, strict=True)],
    })
    return row


def _detail(req: TraceRequest, o: StreamOutcome, start: float) -> dict[str, Any]:
    times = o.token_times()
    return {
        "index": req.index,
        "scheduled_s": req.arrival_s,
        "sent_s": o.sent_at - start,  # arrival, as the metrics count it
        "ttft_s": times[0] - o.sent_at if times else None,
        "token_times_s": [t - o.sent_at for t in times],  # each output token, from arrival
        "e2el_s": None if o.done_at is None else o.done_at - o.sent_at,
        "trace_prompt_len": req.prompt_len,
        "trace_output_len": req.output_len,
        "slo_class": req.slo.name if req.slo else None,
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "output_tokens": len(times),
        "timed_chunks": len(o.chunk_times),
        "finish_reason": o.finish_reason,
        "http_status": o.http_status,
        "replica": o.replica,
        "error": o.error,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000.0:.1f}"


def _num(v: float | None, decimals: int) -> str:
    return "-" if v is None else f"{v:.{decimals}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def format_pass(row: dict[str, Any], ttft_slo_s: float, tbt_slo_s: float) -> str:
    lat = row["latency_s"]
    dist = table(["latency (ms)", "mean", "P50", "P90", "P99"],
                 [[name, *(_ms(lat[key][q]) for q in ("mean", "p50", "p90", "p99"))]
                  for key, name in DISTRIBUTIONS])
    goodput = row["goodput_rps"]
    every_gap = row.get("goodput_every_gap_rps")
    tok_s = row["throughput_tok_s"]
    req_s = row["request_throughput_rps"]
    gap = row.get("max_gap_s")
    lines = [
        f"{row['policy']} @ {row['rps']:g} req/s: {row['requests']} requests, "
        f"{row['completed']} completed, {row['failed']} failed, in {row['duration_s']:.2f} s",
        dist,
        f"SLO attainment: TTFT <= {ttft_slo_s:g} s {_pct(row['ttft_attainment'])}, "
        f"TBT <= {tbt_slo_s * 1000:g} ms {_pct(row['tbt_attainment'])}, "
        f"TPOT <= {tbt_slo_s * 1000:g} ms {_pct(row['tpot_attainment'])}; longest gap "
        f"{'-' if gap is None else f'{gap:.2f} s'}, {row.get('stall_s') or 0:.1f} s of gaps "
        "over the TBT SLO",
        f"goodput {'-' if goodput is None else f'{goodput:.3g}'} req/s (TTFT and TPOT, as "
        f"vLLM counts it; every gap: {'-' if every_gap is None else f'{every_gap:.3g}'}); "
        "throughput "
        f"{'-' if req_s is None else f'{req_s:.3g}'} req/s, "
        f"{'-' if tok_s is None else f'{tok_s:.1f}'} output tok/s; tokens: "
        f"{row['prompt_tokens']} prompt, {row['output_tokens']} output"
        + (f"; server rotations {row['rotations']}" if row["rotations"] is not None else ""),
    ]
    for name, c in sorted((row.get("per_class") or {}).items()):
        lines.append(f"class {name}: {c['requests']} requests, TTFT {_pct(c['ttft_attainment'])}, "
                     f"TBT {_pct(c['tbt_attainment'])}, TPOT {_pct(c['tpot_attainment'])}, "
                     f"goodput {_num(c['goodput_rps'], 3)} req/s")
    lines += format_misses(row)
    pc = row.get("server_prefix_cache") or {}
    if row.get("cached_tokens") is not None or any(v for v in pc.values()):
        rate = row.get("prefix_cache_hit_rate")
        line = (f"prefix cache: {row.get('cached_tokens') or 0} of {row['prompt_tokens']} "
                f"prompt tokens cached ({_pct(rate)})")
        if pc.get("prefix_cache_hits") is not None:
            line += (f"; server hits: device {pc['prefix_cache_hits']} / "
                     f"{pc['prefix_cache_queries']} tokens, host {pc['prefix_cache_host_hits']}"
                     f" / {pc['prefix_cache_host_queries']}")
        lines.append(line)
    if row["untimed_tokens"]:
        lines.append(f"note: {row['untimed_tokens']} tokens came without a chunk of their own "
                     "and were timed at their stream's last chunk")
    if row["max_send_lag_s"] > 0.05:
        lines.append(f"note: a request was sent up to {row['max_send_lag_s']:.2f} s after its "
                     "arrival (--max-concurrency, or a busy client)")
    errors = [d["error"] for d in row["per_request"] if d["error"]]
    if errors:
        lines.append(f"first error: {errors[0]}")
    return "\n".join(lines)


def format_misses(row: dict[str, Any]) -> list[str]:
    """The server's breakdown of the missed requests' time (lines; none without it)."""
    lines = []
    for slo, what in (("ttft", "missed TTFT"), ("tbt", "missed a gap")):
        m = (row.get("server_misses") or {}).get(slo)
        if not m:
            continue
        total = sum(m.get(p, 0.0) for p in PHASE_NAMES)
        shares = ", ".join(f"{p} {100 * m.get(p, 0.0) / total:.0f}%" if total else f"{p} -"
                           for p in PHASE_NAMES)
        lines.append(f"server: {int(m['requests'])} requests {what}; of that time ({total:.1f} s) "
                     f"{shares}")
    return lines


def format_sweep(rows: Sequence[dict[str, Any]]) -> str:
    def pct(v: float | None) -> str:
        return _pct(v).rstrip("%")

    return table(
        ["label", "RPS", "done", "failed", "TTFT%", "TBT%", "TPOT%", "p50TTFT s", "p99TTFT s",
         "p50TBT s", "p99TBT s", "goodput", "ev-gap", "tok/s"],
        [[r["policy"], f"{r['rps']:g}", r["completed"], r["failed"], pct(r["ttft_attainment"]),
          pct(r["tbt_attainment"]), pct(r.get("tpot_attainment")), _num(r["p50_ttft_s"], 2),
          _num(r["p99_ttft_s"], 2), _num(r["p50_tbt_s"], 3), _num(r["p99_tbt_s"], 3),
          _num(r["goodput_rps"], 2), _num(r.get("goodput_every_gap_rps"), 2),
          _num(r["throughput_tok_s"], 1)]
         for r in rows],
    )
