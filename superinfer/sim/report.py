"""The simulator's results as rows, a table a person reads, and the attainment plot rows."""

from __future__ import annotations

import math
from typing import Any

from superinfer.sim.engine import SimResult

# The per-result keys every table and JSON of the simulator carries (and bench serve's).
RESULT_KEYS = (
    "ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s", "p99_tbt_s",
    "goodput_rps", "throughput_tok_s", "rotations",
)


def result_row(rps: float, r: SimResult) -> dict[str, Any]:
    m = r.metrics.as_dict()
    row: dict[str, Any] = {"policy": r.label, "base_policy": r.policy, "rps": rps}
    row.update({k: m[k] for k in RESULT_KEYS})
    for k in ("tbt_attainment_rotated", "tpot_attainment", "p99_tpot_s", "mean_ttft_s",
              "max_gap_s", "stall_s"):
        row[k] = m[k]
    row["requests"] = m["requests"]
    row["completed"] = m["completed"]
    row["stats"] = r.stats
    return row


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    width = max([len(r["policy"]) for r in rows] + [6])
    head = (f"{'policy':<{width}}  {'TTFT%':>6} {'TBT%':>6} {'p50TTFT':>8} {'p99TTFT':>8} "
            f"{'p50TBT':>7} {'p99TBT':>7} {'goodput':>7} {'tok/s':>7} {'rotations':>9} "
            f"{'TPOT%':>6} {'maxgap':>7}")
    lines = [head]
    for r in rows:
        pct = lambda v: _fmt(None if v is None else 100 * v, ".1f")  # noqa: E731
        lines.append(
            f"{r['policy']:<{width}}  {pct(r['ttft_attainment']):>6} {pct(r['tbt_attainment']):>6} "
            f"{_fmt(r['p50_ttft_s'], '.2f'):>8} {_fmt(r['p99_ttft_s'], '.2f'):>8} "
            f"{_fmt(r['p50_tbt_s'], '.3f'):>7} {_fmt(r['p99_tbt_s'], '.3f'):>7} "
            f"{_fmt(r['goodput_rps'], '.2f'):>7} {_fmt(r['throughput_tok_s'], '.0f'):>7} "
            f"{r['rotations']:>9} {pct(r.get('tpot_attainment')):>6} "
            f"{_fmt(r.get('max_gap_s'), '.1f'):>7}"
        )
    return "\n".join(lines)
