"""The scheduler's statistics in a bench result's server /metrics deltas.

`bench serve` records the deltas of the server's counters by sample name
(``superinfer_scheduler_transfer_bytes_total{direction=d2h}``); its readers want them by
the scheduler's own key (``bytes_d2h``). Results written before the scheduler's
cumulative statistics became Prometheus counters hold them as gauges named
``superinfer_scheduler_<key>``; those files are read too. A server with a tenants file
splits the per-tenant statistics by a `tenant` label; a key's value is their sum.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.metrics import SCHEDULER_SERIES


def scheduler_stat(delta: Mapping[str, float], key: str) -> float | None:
    """The change of GetStats' ``key`` over a pass, or None where the result has none."""
    series = SCHEDULER_SERIES[key]
    labels = ",".join(f"{k}={v}" for k, v in sorted(series.labels))
    name = f"{series.sample_name}{{{labels}}}" if labels else series.sample_name
    parts = [v for k, v in delta.items() if _untenanted(k) == name]
    if parts:
        return float(sum(parts))
    value = delta.get(f"superinfer_scheduler_{key}")
    return None if value is None else float(value)


def _untenanted(sample: str) -> str:
    """A delta's key without its tenant label: `n{outcome=met,tenant=a}` -> `n{outcome=met}`."""
    name, brace, labels = sample.partition("{")
    if not brace or "tenant=" not in labels:
        return sample
    rest = [p for p in labels.rstrip("}").split(",") if not p.startswith("tenant=")]
    return f"{name}{{{','.join(rest)}}}" if rest else name
