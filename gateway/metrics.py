"""Prometheus metrics: what the gateway measures itself plus the scheduler's state.

Latencies are measured here, at the front door, because that is what a client sees.
Queue lengths, KV blocks and the scheduler's counters are only known to the scheduler,
so they are fetched with GetStats at scrape time rather than pushed; the registry is
per app so tests can build several gateways in one process.

Names follow Prometheus' conventions (cumulative values are counters ending in
``_total``, levels are gauges, durations are histograms in seconds), and the quantities
vLLM also has are exported a second time under vLLM's names, types and labels
(``vllm:num_requests_waiting{model_name=…,engine="0"}``…), because that is what the
routers that pick a replica (llm-d, the Gateway API Inference Extension) and vLLM's
dashboards read. The ``vllm:`` series are a view of the same samples, rendered in the
same scrape, so the two never disagree. docs/metrics.md lists every series.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

from proto import scheduler_pb2

# Request outcomes for superinfer_requests_total{status}: the finish reasons, plus
# "rejected" (refused before or by the scheduler: 4xx/429) and "error" (5xx mid-way).
STATUSES = ("stop", "length", "abort", "error", "rejected")

# The *_created timestamp series double the exposition for no use here.
disable_created_metrics()

# vLLM's bucket boundaries (vllm/v1/metrics/buckets.py), so that a histogram_quantile()
# or an SLO threshold written for vLLM reads the same from either name.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True, slots=True)
class Series:
    """How one entry of StatsReply.counters is exported."""

    name: str  # the family; a counter's sample adds "_total"
    kind: str  # COUNTER or GAUGE
    help: str
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == COUNTER else self.name


def series_key(flat_key: str) -> str:
    """The statistic a GetStats key belongs to: a histogram travels flattened as
    `<key>:bucket:<le>`, `<key>:sum` and `<key>:count` (scheduler_svc/slo_attribution.py),
    and a named tenant's count as `<key>@<tenant>`."""
    return split_tenant(flat_key)[0].split(":", 1)[0]


def split_tenant(flat_key: str) -> tuple[str, str]:
    """(`<key>`, `<tenant>`) of a per-tenant key `<key>@<tenant>`; (key, "") of the rest."""
    key, _, tenant = flat_key.partition("@")
    return key, tenant


def _with_tenant(labels: Iterable[tuple[str, str]], tenant: str) -> dict[str, str]:
    """A sample's labels: tenant "" (no tenants file) has no tenant label, which
    Prometheus reads as tenant="", so `sum()` over a family is still the total."""
    return {**dict(labels), **({"tenant": tenant} if tenant else {})}


def _counter(name: str, help: str, **labels: str) -> Series:
    return Series(name, COUNTER, help, tuple(labels.items()))


def _gauge(name: str, help: str) -> Series:
    return Series(name, GAUGE, help)


_S = "superinfer_scheduler_"
_BYTES = "KV-cache bytes moved between device and host, per direction"
_COPY = "Time kvmem spent copying KV blocks, per direction"
_LOSSES = "A peer came back with a new pool: tier device = a new worker, host = a new kvmem"
_RESUMED = "Requests resumed after a pool loss: from host copies (swap_in) or by recompute"
_TTFT = "Finished requests by whether their first token came within their TTFT SLO"
_TBT = "Gaps between a request's consecutive tokens by whether they were within its TBT SLO"
_GOOD = ("Goodput: requests that ended by stop or length with TTFT within their TTFT SLO "
         "and TPOT (mean gap, first token to last) within their TBT SLO; vLLM's bench --goodput")
_MISS = ("Seconds each request that missed an SLO spent in each phase of the missed intervals: "
         "slo=ttft its TTFT, slo=tbt its gaps longer than its TBT SLO; phase waiting (queued, "
         "no KV on the device), rotary (parked in host memory), computing (on the device, the "
         "worker busy), transfer (on the device, the worker idle for its KV copies)")
_PHASES = ("waiting", "rotary", "computing", "transfer")


def _miss(slo: str, phase: str) -> Series:
    return Series("superinfer_slo_miss_phase_seconds", HISTOGRAM, _MISS,
                  (("slo", slo), ("phase", phase)))
_PC_Q = ("Prompt tokens looked up in the prefix cache at admission, per tier (host: the "
         "tokens the device tier missed)")
_PC_H = "Prompt tokens served from the prefix cache, per tier (host: copied in, not recomputed)"

# Every statistic GetStats sends (SchedulerStats, EngineStats, LoopStats), by its key. A test checks
# that the scheduler sends exactly these, so a new one cannot slip out as the wrong type.
SCHEDULER_SERIES: dict[str, Series] = {
    # the iteration loop
    "iterations": _counter(_S + "iterations", "Iterations of the scheduling loop"),
    "decision_s_total": _counter(_S + "decision_seconds", "Time spent in schedule() decisions"),
    "decision_s_max": _gauge(_S + "decision_max_seconds", "Longest single schedule() decision"),
    "executes": _counter(_S + "executes", "Batches the worker executed"),
    "execute_s": _counter(_S + "execute_seconds", "Worker compute time of the executed batches"),
    "execute_rpc_s": _counter(_S + "execute_rpc_seconds",
                              "Wall time of Execute calls, RPC and queueing behind the batch "
                              "in flight included"),
    "execute_wait_s": _counter(_S + "execute_wait_seconds",
                               "Time the engine step waited for a batch's output (pipelined: "
                               "what planning and transfers did not hide)"),
    # rotation (RotaSched)
    "preemptions": _counter(_S + "preemptions",
                            "Running requests taken off the device: rotated out or recomputed"),
    "growth_preemptions": _counter(_S + "growth_preemptions",
                                   "Preemptions that gave a running request the blocks its "
                                   "next tokens need (the rest: for a candidate)"),
    "parked_preemptions": _counter(_S + "parked_preemptions",
                                   "Preemptions that seated a parked (rotary) request: one "
                                   "started request traded for another"),
    "rotations": _counter(_S + "rotations", "Requests rotated out to the host pool"),
    "recomputes": _counter(_S + "recomputes",
                           "Preempted requests sent back to waiting to recompute their KV"),
    "swap_out_blocks": _counter(_S + "swap_out_blocks", "KV blocks copied to the host at rotate-out"),
    "swap_in_blocks": _counter(_S + "swap_in_blocks", "KV blocks copied to the device at swap-in"),
    "eager_blocks": _counter(_S + "eager_blocks",
                             "Full KV blocks copied to the host ahead of rotation (eager copies)"),
    "freed_without_copy": _counter(_S + "freed_without_copy_blocks",
                                   "Device blocks freed at rotate-out without a copy, thanks to "
                                   "an eager copy"),
    # prefix caching
    "prefix_cache_queries": _counter(_S + "prefix_cache_queries_tokens", _PC_Q, tier="device"),
    "prefix_cache_host_queries": _counter(_S + "prefix_cache_queries_tokens", _PC_Q, tier="host"),
    "prefix_cache_hits": _counter(_S + "prefix_cache_hits_tokens", _PC_H, tier="device"),
    "prefix_cache_host_hits": _counter(_S + "prefix_cache_hits_tokens", _PC_H, tier="host"),
    "swap_in_cached_blocks": _counter(_S + "swap_in_cached_blocks",
                                      "Blocks a swap-in found still cached on the device: not "
                                      "copied"),
    "deferred_swap_ins": _counter(_S + "deferred_swap_ins",
                                  "Pipelined admissions whose swap-ins waited for the batch in "
                                  "flight: they computed from the batch after, not holding one "
                                  "back"),
    # transfers (DuplexKV)
    "transfers": _counter(_S + "transfers", "Transfer batches sent to kvmem"),
    "transfer_s": _counter(_S + "transfer_seconds", "Wall time of Transfer calls, RPC included"),
    "transfer_wait_s": _counter(_S + "transfer_wait_seconds",
                                "Time the engine step itself waited on transfers (pipelined: "
                                "after-batch copies run beside the next batch)"),
    "transfer_wait_max_s": _gauge(_S + "transfer_wait_max_seconds",
                                  "Longest time one iteration waited on its transfers"),
    "transfer_stall_s": _counter(_S + "transfer_stall_seconds",
                                 "Time the worker sat idle before a batch for its KV copies"),
    "bytes_d2h": _counter(_S + "transfer_bytes", _BYTES, direction="d2h"),
    "bytes_h2d": _counter(_S + "transfer_bytes", _BYTES, direction="h2d"),
    "kvmem_d2h_s": _counter(_S + "kvmem_copy_seconds", _COPY, direction="d2h"),
    "kvmem_h2d_s": _counter(_S + "kvmem_copy_seconds", _COPY, direction="h2d"),
    # requests
    "finished": _counter(_S + "finished", "Requests finished by stop or length"),
    "aborted": _counter(_S + "aborted", "Requests aborted (client gone, error, shutdown)"),
    "slo_ttft_met": _counter("superinfer_slo_ttft_requests", _TTFT, outcome="met"),
    "slo_ttft_missed": _counter("superinfer_slo_ttft_requests", _TTFT, outcome="missed"),
    "slo_tbt_met": _counter("superinfer_slo_tbt_gaps", _TBT, outcome="met"),
    "slo_tbt_missed": _counter("superinfer_slo_tbt_gaps", _TBT, outcome="missed"),
    "slo_good": _counter("superinfer_slo_good_requests", _GOOD),
    # per pair of tenants: `slo_miss_blame_s:<holder>[@<tenant>]` (SUFFIX_LABELS)
    "slo_miss_blame_s": _counter(
        "superinfer_slo_miss_blame_seconds",
        "Seconds the missed intervals (a TTFT over S_B, a gap over S_F) of tenant's requests "
        "sat queued (waiting or rotary) while the tenant `behind`'s requests held the device, "
        "split by their share of the KV blocks in use"),
    "service_tokens": _counter(
        "superinfer_tenant_service_tokens",
        "Prompt and output tokens scheduled for the tenant's requests (fair shares count them)"),
    "device_block_seconds": _counter(
        "superinfer_tenant_device_block_seconds",
        "Device KV block-seconds the tenant's running requests held (fair shares count them)"),
    **{f"slo_miss_{slo}_{phase}_s": _miss(slo, phase) for slo in ("ttft", "tbt")
       for phase in _PHASES},
    # speculative decoding (--speculative-config), vLLM's counters
    "spec_decode_num_drafts": _counter(_S + "spec_decode_drafts",
                                       "Decode chunks that carried drafts to verify"),
    "spec_decode_num_draft_tokens": _counter(_S + "spec_decode_draft_tokens",
                                             "Draft tokens proposed and verified"),
    "spec_decode_num_accepted_tokens": _counter(_S + "spec_decode_accepted_tokens",
                                                "Draft tokens the model agreed with"),
    # `spec_decode_num_accepted_tokens_per_pos:<i>` (SUFFIX_LABELS)
    "spec_decode_num_accepted_tokens_per_pos": _counter(
        _S + "spec_decode_accepted_tokens_per_pos",
        "Draft tokens accepted at each position of the drafts (0: the first)"),
    # outages of the worker or kvmem (DESIGN 6)
    "backend_errors": _counter(_S + "backend_errors", "Iterations that failed"),
    "recoveries": _counter(_S + "recoveries",
                           "Outages of the worker or kvmem recovered from without failing a "
                           "request"),
    "device_losses": _counter(_S + "pool_losses", _LOSSES, tier="device"),
    "host_losses": _counter(_S + "pool_losses", _LOSSES, tier="host"),
    "resumed_swap_in": _counter(_S + "resumed_requests", _RESUMED, via="swap_in"),
    "resumed_recompute": _counter(_S + "resumed_requests", _RESUMED, via="recompute"),
    "last_outage_s": _gauge(_S + "last_outage_seconds",
                            "Length of the last outage, failed iteration to repaired state"),
    "uptime_s": _gauge(_S + "uptime_seconds", "Seconds since the scheduler started"),
}

# vLLM labels every series with the served model and its engine core; a replica here is
# one engine, which vLLM numbers 0.
VLLM_ENGINE = "0"
# vLLM's finished_reason values (FinishReason); a request here never ends by "repetition",
# but the series exists at 0 as it does in vLLM.
VLLM_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "superinfer_requests", "Finished requests by outcome", ["status"], registry=r
        )
        for status in STATUSES:  # export zeros so rate() works from the first scrape
            self.requests.labels(status)
        self.prompt_tokens = TenantCounter(
            "superinfer_prompt_tokens", "Prompt tokens of requests that got a first token")
        r.register(self.prompt_tokens)
        self.generation_tokens = TenantCounter("superinfer_generation_tokens", "Tokens generated")
        r.register(self.generation_tokens)
        self.ttft = Histogram(
            "superinfer_time_to_first_token_seconds", "Arrival to first token",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "superinfer_inter_token_latency_seconds", "Gap between consecutive tokens",
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "superinfer_e2e_request_latency_seconds", "Arrival to last token",
            buckets=E2E_BUCKETS, registry=r,
        )
        self.scheduler = SchedulerStatsCollector()
        r.register(self.scheduler)
        self.vllm = VLLMView(self)
        r.register(self.vllm)

    def render(self, stats: scheduler_pb2.StatsReply | None, model_name: str | None) -> bytes:
        """Exposition text; ``stats`` None means the scheduler did not answer, and
        ``model_name`` None (not known yet) leaves out the vLLM-named series."""
        self.scheduler.stats = self.vllm.stats = stats
        self.vllm.model_name = model_name
        return generate_latest(self.registry)


class TenantCounter(Collector):
    """A counter per tenant, exported as the scheduler's per-tenant series are: tenant ""
    (no tenants file) without the label, a named tenant with tenant="<name>". Tenants
    come from the tenants file, so the label's values are bounded."""

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.values: dict[str, float] = {"": 0.0}  # tenant "" from the start, for rate()

    def inc(self, amount: float, tenant: str = "") -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up, got {amount}")
        self.values[tenant] = self.values.get(tenant, 0.0) + amount

    @property
    def total(self) -> float:
        return sum(self.values.values())

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.help)
        for tenant, value in sorted(self.values.items()):
            fam.add_sample(self.name + "_total", _with_tenant((), tenant), value)
        yield fam


class SchedulerStatsCollector(Collector):
    """The latest StatsReply (set just before each scrape) as gauges and counters."""

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
        capacity = GaugeMetricFamily(
            "superinfer_kv_blocks_capacity", "KV blocks per tier", labels=["tier"]
        )
        free = GaugeMetricFamily("superinfer_kv_blocks_free", "Free KV blocks per tier", labels=["tier"])
        usage = GaugeMetricFamily(
            "superinfer_kv_usage_ratio", "Share of KV blocks in use per tier", labels=["tier"]
        )
        for tier, (n, f) in tiers.items():
            capacity.add_metric([tier], n)
            free.add_metric([tier], f)
            usage.add_metric([tier], kv_usage(n, f))
        yield capacity
        yield free
        yield usage
        yield from scheduler_families(s.counters)


def kv_usage(total: int, free: int) -> float:
    return (total - free) / total if total > 0 else 0.0


# Keys whose part after ":" is a label's value (not a histogram's part).
SUFFIX_LABELS = {"slo_miss_blame_s": "behind",
                 "spec_decode_num_accepted_tokens_per_pos": "position"}
# Sent only once requests of several tenants were seen (a server with a tenants file).
TENANTS_ONLY = frozenset({"slo_miss_blame_s", "service_tokens", "device_block_seconds"})
# Sent only by a scheduler that speculates (--speculative-config).
SPECULATIVE_ONLY = frozenset({"spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                              "spec_decode_num_accepted_tokens",
                              "spec_decode_num_accepted_tokens_per_pos"})


def scheduler_families(counters: dict[str, float]) -> Iterator[Metric]:
    """StatsReply.counters as typed families, a key `<key>@<tenant>` as `<key>`'s series
    with the label tenant="<tenant>"; keys this gateway does not know (a newer scheduler)
    come out untyped rather than guessed."""
    families: dict[str, Metric] = {}
    histograms: dict[tuple[str, str], dict[str, float]] = {}
    for flat in sorted(counters):
        key, tenant = split_tenant(flat)
        series = SCHEDULER_SERIES.get(series_key(key))
        if series is None:
            name = _S + _metric_name(key)
            fam = families.get(name)
            if fam is None:
                fam = families[name] = UnknownMetricFamily(
                    name, f"Scheduler statistic {key!r} (unknown to this gateway)")
            fam.add_sample(name, _with_tenant((), tenant), counters[flat])
            continue
        if series.kind == HISTOGRAM:
            histograms.setdefault((series_key(key), tenant), {})[key.partition(":")[2]] = (
                counters[flat])
            continue
        suffix = SUFFIX_LABELS.get(series_key(key))
        extra = ((suffix, key.partition(":")[2]),) if suffix else ()
        fam = families.get(series.name)
        if fam is None:
            cls = CounterMetricFamily if series.kind == COUNTER else GaugeMetricFamily
            fam = families[series.name] = cls(series.name, series.help)
        fam.add_sample(series.sample_name, _with_tenant(series.labels + extra, tenant),
                       counters[flat])
    hists: dict[str, Metric] = {}
    for (key, tenant), parts in histograms.items():
        series = SCHEDULER_SERIES[key]
        labels = _with_tenant(series.labels, tenant)
        one = HistogramMetricFamily(series.name, series.help, labels=list(labels))
        buckets = sorted(((k.split(":", 1)[1], v) for k, v in parts.items()
                          if k.startswith("bucket:")), key=lambda kv: float(kv[0]))
        one.add_metric(list(labels.values()), buckets, parts.get("sum", 0.0))
        hist = hists.setdefault(series.name, one)
        if hist is not one:  # several label sets (or tenants) of one family
            hist.samples.extend(one.samples)
    known = [f for f in families.values() if not isinstance(f, UnknownMetricFamily)]
    yield from known
    yield from hists.values()
    yield from (f for f in families.values() if isinstance(f, UnknownMetricFamily))


class VLLMView(Collector):
    """vLLM's names for the quantities both servers have, from the same samples.

    What vLLM calls waiting is everything not on the device, so rotary requests count
    as waiting: a router reading it sees the load a new request would queue behind.
    """

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.stats: scheduler_pb2.StatsReply | None = None
        self.model_name: str | None = None

    def collect(self) -> Iterator[Metric]:
        if self.model_name is None:
            return
        labels = {"model_name": self.model_name, "engine": VLLM_ENGINE}
        names, values = list(labels), list(labels.values())
        m, s = self.metrics, self.stats
        if s is not None:
            for name, help, value in [
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 s.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed "
                 "(SuperInfer: waiting + rotary).", s.waiting + s.rotary),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                 "(SuperInfer: the device tier).",
                 kv_usage(s.device_blocks_total, s.device_blocks_free)),
            ]:
                gauge = GaugeMetricFamily(name, help, labels=names)
                gauge.add_metric(values, value)
                yield gauge
            preempted = CounterMetricFamily(
                "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                labels=names)
            preempted.add_metric(values, s.counters.get("preemptions", 0.0))
            yield preempted
            # vLLM counts its GPU prefix cache as prefix_cache_* and what a KV connector
            # (CPU offloading, LMCache) serves as external_prefix_cache_*: here, the device
            # and the host tier. All in tokens.
            for name, key, help in [
                ("vllm:prefix_cache_queries", "prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits", "prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens."),
                ("vllm:external_prefix_cache_queries", "prefix_cache_host_queries",
                 "External prefix cache queries, in terms of number of queried tokens "
                 "(SuperInfer: the host tier)."),
                ("vllm:external_prefix_cache_hits", "prefix_cache_host_hits",
                 "External prefix cache hits, in terms of number of cached tokens "
                 "(SuperInfer: the host tier)."),
            ]:
                counter = CounterMetricFamily(name, help, labels=names)
                counter.add_metric(values, s.counters.get(key, 0.0))
                yield counter
            if "spec_decode_num_drafts" in s.counters:
                yield from _spec_decode(s.counters, names, values)
        for tokens, name, help in [
            (m.prompt_tokens, "vllm:prompt_tokens", "Number of prefill tokens processed."),
            (m.generation_tokens, "vllm:generation_tokens", "Number of generation tokens processed."),
        ]:
            counter = CounterMetricFamily(name, help, labels=names)
            counter.add_metric(values, tokens.total)  # vLLM has no tenants: all of them
            yield counter
        for ours, name, help in [
            (m.ttft, "vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds."),
            (m.itl, "vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds."),
            (m.e2e, "vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds."),
        ]:
            yield from _renamed(ours.collect(), name, help, labels)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=[*names, "finished_reason"])
        by_status = {s.labels["status"]: s.value for fam in m.requests.collect()
                     for s in fam.samples if s.name.endswith("_total")}
        for reason in VLLM_FINISHED_REASONS:
            success.add_metric([*values, reason], by_status.get(reason, 0.0))
        yield success


def _spec_decode(counters: Mapping[str, float], names: list[str], values: list[str]
                 ) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, from the scheduler's."""
    for key, help in [
        ("spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ]:
        counter = CounterMetricFamily("vllm:" + key, help, labels=names)
        counter.add_metric(values, counters.get(key, 0.0))
        yield counter
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.",
                                  labels=[*names, "position"])
    prefix = "spec_decode_num_accepted_tokens_per_pos:"
    positions = sorted(int(k[len(prefix):]) for k in counters if k.startswith(prefix))
    for i in positions:
        per_pos.add_metric([*values, str(i)], counters[f"{prefix}{i}"])
    yield per_pos


def _renamed(families: Iterable[Metric], name: str, help: str, labels: dict[str, str]
             ) -> Iterator[Metric]:
    """Each sample of ``families`` under ``name`` (suffixes kept) with ``labels`` added."""
    for fam in families:
        out = Metric(name, help, fam.type)
        for s in fam.samples:
            out.add_sample(name + s.name[len(fam.name):], {**labels, **s.labels}, s.value)
        yield out


def _metric_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_").lower() or "unnamed"
