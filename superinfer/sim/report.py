"""The simulator's results as rows, a table a person reads, and the attainment plot rows."""

from __future__ import annotations

import math
from typing import Any

from scheduler_svc.request import PHASES
from superinfer.sim.engine import SimResult

# The per-result keys every table and JSON of the simulator carries (and bench serve's).
RESULT_KEYS = (
    "ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s", "p99_tbt_s",
    "goodput_rps", "throughput_tok_s", "rotations",
)
# ... and beside them (DESIGN §8: per-gap TBT alone hides a parked request).
EXTRA_KEYS = ("tbt_attainment_rotated", "tpot_attainment", "tpot_attainment_rotated", "p99_tpot_s", "mean_ttft_s",
              "max_gap_s", "stall_s", "goodput_every_gap_rps", "good_requests",
              "ttft_missed", "miss_ttft_s", "tbt_missed", "miss_tbt_s", "per_class")


def result_row(rps: float, r: SimResult) -> dict[str, Any]:
    m = r.metrics.as_dict()
    row: dict[str, Any] = {"policy": r.label, "base_policy": r.policy, "rps": rps}
    row.update({k: m[k] for k in RESULT_KEYS})
    for k in EXTRA_KEYS:
        row[k] = m[k]
    row["requests"] = m["requests"]
    row["completed"] = m["completed"]
    row["stats"] = r.stats
    return row


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _pct(v: Any) -> str:
    return _fmt(None if v is None else 100 * v, ".1f")


def format_table(rows: list[dict[str, Any]]) -> str:
    width = max([len(r["policy"]) for r in rows] + [6])
    head = (f"{'policy':<{width}}  {'TTFT%':>6} {'TBT%':>6} {'TPOT%':>6} {'p50TTFT':>8} "
            f"{'p99TTFT':>8} {'p50TBT':>7} {'p99TBT':>7} {'goodput':>7} {'ev-gap':>7} "
            f"{'tok/s':>7} {'rotations':>9} {'maxgap':>7}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['policy']:<{width}}  {_pct(r['ttft_attainment']):>6} {_pct(r['tbt_attainment']):>6} "
            f"{_pct(r.get('tpot_attainment')):>6} "
            f"{_fmt(r['p50_ttft_s'], '.2f'):>8} {_fmt(r['p99_ttft_s'], '.2f'):>8} "
            f"{_fmt(r['p50_tbt_s'], '.3f'):>7} {_fmt(r['p99_tbt_s'], '.3f'):>7} "
            f"{_fmt(r['goodput_rps'], '.2f'):>7} {_fmt(r.get('goodput_every_gap_rps'), '.2f'):>7} "
            f"{_fmt(r['throughput_tok_s'], '.0f'):>7} {r['rotations']:>9} "
            f"{_fmt(r.get('max_gap_s'), '.1f'):>7}"
        )
    return "\n".join(lines)


def format_misses(rows: list[dict[str, Any]]) -> str:
    """Where the missed requests' time went (SLO-miss attribution), per policy: for the
    requests that missed TTFT, the share of their TTFT in each phase; for the gaps longer
    than the TBT SLO, the share of their length."""
    width = max([len(r["policy"]) for r in rows] + [6])
    cols = " ".join(f"{p:>9}" for p in PHASES)
    lines = [f"{'policy':<{width}}  {'misses':>8} {'seconds':>9}  {cols}"]
    for r in rows:
        for slo, n_key, s_key in (("TTFT", "ttft_missed", "miss_ttft_s"),
                                  ("TBT gaps", "tbt_missed", "miss_tbt_s")):
            phases = r.get(s_key) or {}
            total = sum(phases.values())
            shares = " ".join(
                f"{_fmt(100 * phases.get(p, 0.0) / total if total else None, '.1f'):>8}%"
                for p in PHASES)
            lines.append(f"{r['policy']:<{width}}  {r.get(n_key, 0):>8} {total:>9.0f}  {shares}"
                         f"  {slo}")
    return "\n".join(lines)


def format_preemptions(rows: list[dict[str, Any]]) -> str:
    """Why running requests left the device, per policy: to seat a new request, to seat a
    parked one (a started request traded for another), or for a running one's growth."""
    width = max([len(r["policy"]) for r in rows] + [6])
    lines = [f"{'policy':<{width}}  {'preempted':>9} {'for new':>8} {'for parked':>10} "
             f"{'growth':>7} {'recomputed':>10}"]
    for r in rows:
        s = r.get("stats") or {}
        total, parked, growth = (s.get(k, 0) for k in
                                 ("preemptions", "parked_preemptions", "growth_preemptions"))
        lines.append(f"{r['policy']:<{width}}  {total:>9} {total - parked - growth:>8} "
                     f"{parked:>10} {growth:>7} {s.get('recomputes', 0):>10}")
    return "\n".join(lines)


def format_classes(rows: list[dict[str, Any]]) -> str:
    """Attainment per SLO class (heterogeneous SLOs), or '' when the run has no classes."""
    if not any(r.get("per_class") for r in rows):
        return ""
    width = max([len(r["policy"]) for r in rows] + [6])
    lines = [f"{'policy':<{width}}  {'class':<12} {'requests':>8} {'TTFT%':>6} {'TBT%':>6} "
             f"{'TPOT%':>6} {'goodput':>7}"]
    for r in rows:
        for name, c in sorted((r.get("per_class") or {}).items()):
            lines.append(f"{r['policy']:<{width}}  {name:<12} {c['requests']:>8} "
                         f"{_pct(c['ttft_attainment']):>6} {_pct(c['tbt_attainment']):>6} "
                         f"{_pct(c['tpot_attainment']):>6} {_fmt(c['goodput_rps'], '.2f'):>7}")
    return "\n".join(lines)
