"""Prometheus metrics: what the gateway measures itself plus the scheduler's state.

Latencies are measured here, at the front door, because that is what a client sees.
Queue lengths, KV blocks and the scheduler's counters are only known to the scheduler,
so they are fetched with GetStats at scrape time rather than pushed; the registry is
per app so tests can build several gateways in one process.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proto import scheduler_pb2

# Request outcomes for superinfer_requests_total{status}: the finish reasons, plus
# "rejected" (refused before or by the scheduler: 4xx/429) and "error" (5xx mid-way).
STATUSES = ("stop", "length", "abort", "error", "rejected")

# The *_created timestamp series double the exposition for no use here.
disable_created_metrics()

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "superinfer_requests", "Finished requests by outcome", ["status"], registry=r
        )
        for status in STATUSES:  # export zeros so rate() works from the first scrape
            self.requests.labels(status)
        self.prompt_tokens = Counter(
            "superinfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "superinfer_generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "superinfer_time_to_first_token_seconds", "Arrival to first token",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "superinfer_inter_token_latency_seconds", "Gap between consecutive tokens",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "superinfer_e2e_request_latency_seconds", "Arrival to last token",
            buckets=_E2E_BUCKETS, registry=r,
        )
        self.scheduler = SchedulerStatsCollector()
        r.register(self.scheduler)

    def render(self, stats: scheduler_pb2.StatsReply | None) -> bytes:
        """Exposition text; ``stats`` None means the scheduler did not answer."""
        self.scheduler.stats = stats
        return generate_latest(self.registry)


class SchedulerStatsCollector(Collector):
    """Gauges from the latest StatsReply (set just before each scrape)."""

    def __init__(self) -> None:
        self.stats: scheduler_pb2.StatsReply | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily(
            "superinfer_scheduler_up", "1 when the scheduler answered GetStats", value=int(s is not None)
        )
        if s is None:
            return
        for state in ("running", "waiting", "rotary"):
            yield GaugeMetricFamily(
                f"superinfer_requests_{state}", f"Requests {state} in the scheduler",
                value=getattr(s, state),
            )
        tiers = {
            "device": (s.device_blocks_total, s.device_blocks_free),
            "host": (s.host_blocks_total, s.host_blocks_free),
        }
        total = GaugeMetricFamily("superinfer_kv_blocks_total", "KV blocks per tier", labels=["tier"])
        free = GaugeMetricFamily("superinfer_kv_blocks_free", "Free KV blocks per tier", labels=["tier"])
        usage = GaugeMetricFamily(
            "superinfer_kv_usage_ratio", "Share of KV blocks in use per tier", labels=["tier"]
        )
        for tier, (n, f) in tiers.items():
            total.add_metric([tier], n)
            free.add_metric([tier], f)
            usage.add_metric([tier], (n - f) / n if n > 0 else 0.0)
        yield total
        yield free
        yield usage
        for name, value in sorted(s.counters.items()):
            metric = "superinfer_scheduler_" + _metric_name(name)
            if metric == "superinfer_scheduler_up":
                continue
            yield GaugeMetricFamily(metric, f"Scheduler counter {name}", value=value)


def _metric_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_").lower() or "unnamed"
