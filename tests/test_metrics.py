"""/metrics as Prometheus, Grafana and inference routers read it, on a real stack.

One stack (worker with 16 device blocks, kvmem, scheduler, gateway) serves ten streams at
once, which it can only do by rotating requests through host memory, while a real
Prometheus (Debian's `prometheus` package) scrapes it every second. Checked as a user
would notice: promtool's verdict on the live exposition, the vLLM-named series a router
reads (types, labels, buckets, and values equal to SuperInfer's own in the same scrape),
counters that count what was served, every Grafana panel's query naming exported series
and answering in Prometheus, and PromQL rates of tokens and rotations above zero.

promtool and Prometheus tests skip where the package is not installed, unless
SUPERINFER_REQUIRE_PROMETHEUS=1 (set by .ci/run once it has installed it): then they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.daemon import free_port
from gateway.metrics import (
    COUNTER,
    SCHEDULER_SERIES,
    SPECULATIVE_ONLY,
    TENANTS_ONLY,
    series_key,
)
from scheduler_svc.engine_core import EngineStats
from scheduler_svc.loop import LoopStats
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import SchedulerStats
from scheduler_svc.speculative import SpecStats
from superinfer.bench.serve.runner import scrape
from superinfer.bench.server_stats import scheduler_stat
from superinfer.probes import grpc_probe, http_probe
from superinfer.supervisor import ServiceSpec, Supervisor
from tests.prompts import PROMPTS

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "superinfer.json"
START_TIMEOUT_S = 240.0
DEVICE_BLOCKS = 16  # 256 tokens of device KV for ten ~60-token requests: rotation or bust
STREAMS = 10
MAX_TOKENS = 40
REQUIRE_PROMETHEUS = os.environ.get("SUPERINFER_REQUIRE_PROMETHEUS") == "1"

# vLLM's series for the quantities SuperInfer also has, with vLLM's types
# (vllm/v1/metrics/loggers.py) and, for histograms, its bucket bounds
# (vllm/v1/metrics/buckets.py), written out here independently of gateway/metrics.py.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter",
    "vllm:external_prefix_cache_hits": "counter",
}
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0],
}
# The SuperInfer series each vLLM one must equal: (name, labels), summed where several.
VLLM_EQUALS: dict[str, list[tuple[str, dict[str, str]]]] = {
    "vllm:num_requests_running": [("superinfer_requests_running", {})],
    # Rotary requests count as waiting for a router: they wait for the device too.
    "vllm:num_requests_waiting": [("superinfer_requests_waiting", {}),
                                  ("superinfer_requests_rotary", {})],
    "vllm:kv_cache_usage_perc": [("superinfer_kv_usage_ratio", {"tier": "device"})],
    "vllm:num_preemptions_total": [("superinfer_scheduler_preemptions_total", {})],
    "vllm:prompt_tokens_total": [("superinfer_prompt_tokens_total", {})],
    "vllm:generation_tokens_total": [("superinfer_generation_tokens_total", {})],
    # vLLM's GPU prefix cache is the device tier; what its KV connectors serve, the host tier.
    "vllm:prefix_cache_queries_total": [
        ("superinfer_scheduler_prefix_cache_queries_tokens_total", {"tier": "device"})],
    "vllm:prefix_cache_hits_total": [
        ("superinfer_scheduler_prefix_cache_hits_tokens_total", {"tier": "device"})],
    "vllm:external_prefix_cache_queries_total": [
        ("superinfer_scheduler_prefix_cache_queries_tokens_total", {"tier": "host"})],
    "vllm:external_prefix_cache_hits_total": [
        ("superinfer_scheduler_prefix_cache_hits_tokens_total", {"tier": "host"})],
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# -- the stack, its traffic, Prometheus ---------------------------------------------------------


@dataclass
class Stack:
    run_dir: Path
    http_url: str
    model: str

    def scrape(self) -> str:
        with httpx.Client(base_url=self.http_url, trust_env=False, timeout=30) as h:
            r = h.get("/metrics")
        assert r.status_code == 200, r.text
        return r.text


class Prometheus:
    """A Prometheus server scraping one gateway every second, in its own directory."""

    def __init__(self, binary: str, run_dir: Path, target: str) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: superinfer\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = run_dir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={run_dir / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to; Prometheus's own error otherwise."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        with httpx.Client(trust_env=False, timeout=10) as h:
            body = h.get(f"{self.url}/api/v1/query", params=params).json()
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {expr!r}: {body.get('error')}")
        return list(body["data"]["result"])

    def wait_for_scrape(self, after: float, timeout_s: float = 30.0) -> None:
        """Until Prometheus holds a scrape of the gateway taken after unix time ``after``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                got = self.query("timestamp(superinfer_scheduler_up)")
            except (httpx.HTTPError, ValueError):
                got = []  # still starting
            if got and float(got[0]["value"][1]) > after:
                return
            time.sleep(0.2)
        raise AssertionError(f"no scrape after {after} within {timeout_s} s: "
                             f"{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Served:
    stack: Stack
    busy: str  # a /metrics scrape taken while requests were queued and rotated
    idle: str  # one taken after every request finished
    end: float  # unix time the last request finished
    prometheus: Prometheus | None
    no_prometheus: str  # why there is none


def _missing(tool: str) -> str | None:
    if shutil.which(tool):
        return None
    why = (f"{tool} not found: install Debian's prometheus package "
           "(apt-get install prometheus), as .ci/run does")
    if REQUIRE_PROMETHEUS:
        pytest.fail(f"{why}; SUPERINFER_REQUIRE_PROMETHEUS=1 says it must be here")
    return why


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("metrics-stack")
    addr = {name: f"127.0.0.1:{free_port()}" for name in ("worker", "kvmem", "scheduler", "http")}
    cli = [sys.executable, "-m", "superinfer.cli"]

    def flags(name: str) -> list[str]:
        return ["--run-dir", str(run_dir), "--port", addr[name].rsplit(":", 1)[1]]

    specs = [
        ServiceSpec("worker", [*cli, "worker", *flags("worker"), "--device-blocks",
                               str(DEVICE_BLOCKS)], grpc_probe(addr["worker"])),
        ServiceSpec("kvmem", [*cli, "kvmem", *flags("kvmem"), "--host-blocks", "256"],
                    grpc_probe(addr["kvmem"])),
        ServiceSpec("scheduler", [*cli, "scheduler", *flags("scheduler"),
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"]],
                    grpc_probe(addr["scheduler"])),
        ServiceSpec("gateway", [*cli, "gateway", *flags("http"), "--grpc-port", "0",
                                "--scheduler-addr", addr["scheduler"]],
                    http_probe(f"http://{addr['http']}/health")),
    ]
    sup = Supervisor(run_dir)
    try:
        for spec in specs:
            sup.start(spec, START_TIMEOUT_S)
        with httpx.Client(trust_env=False) as h:
            model = h.get(f"http://{addr['http']}/v1/models").json()["data"][0]["id"]
        yield Stack(run_dir, f"http://{addr['http']}", model)
    finally:
        sup.stop_all()


@pytest.fixture(scope="module")
def served(stack: Stack) -> Iterator[Served]:
    why = _missing("prometheus")
    prom = None if why else Prometheus(str(shutil.which("prometheus")),
                                       stack.run_dir / "prometheus",
                                       stack.http_url.removeprefix("http://"))
    try:
        if prom is not None:
            prom.wait_for_scrape(after=0.0)  # it has a sample from before the traffic
        busy = asyncio.run(_serve_rotating_load(stack))
        end = time.time()
        idle = stack.scrape()
        if prom is not None:
            prom.wait_for_scrape(after=end + 1.0)
        yield Served(stack, busy, idle, end, prom, why or "")
    finally:
        if prom is not None:
            prom.stop()


async def _serve_rotating_load(stack: Stack) -> str:
    """Serve the streams; return the scrape taken while most requests were off the device."""
    async with httpx.AsyncClient(base_url=stack.http_url, trust_env=False, timeout=300) as c:
        async def one(i: int) -> None:
            r = await c.post("/v1/completions", json={
                "model": stack.model, "prompt": f"{PROMPTS[i % len(PROMPTS)]} #{i}",
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        busiest, best = "", (-1.0, -1.0)
        while not all(t.done() for t in tasks):
            text = (await c.get("/metrics")).text
            m = _samples(text)
            rank = (min(_value(m, "superinfer_requests_rotary"),
                        _value(m, "superinfer_requests_running")),
                    _value(m, "superinfer_requests_waiting") + _value(m, "superinfer_requests_rotary"))
            if rank > best:
                busiest, best = text, rank
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
    assert best[0] > 0, "no scrape caught a request rotary beside a running one"
    return busiest


def _samples(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _types(text: str) -> dict[str, str]:
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def _value(m: Samples, name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


def _promtool(text: str) -> tuple[int, list[str]]:
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    return done.returncode, [x for x in (done.stdout + done.stderr).splitlines() if x.strip()]


def _without_vllm(text: str) -> str:
    def name(line: str) -> str:
        return line.split()[2] if line.startswith("# ") else line
    return "".join(x for x in text.splitlines(keepends=True) if not name(x).startswith("vllm:"))


# -- promtool ------------------------------------------------------------------------------------


def test_promtool_finds_nothing_but_the_colons_of_vllms_names(served: Served) -> None:
    why = _missing("promtool")
    if why:
        pytest.skip(why)
    rc, problems = _promtool(served.busy)
    # vLLM's names carry a colon, which promtool's linter reserves for recording rules;
    # vLLM's own /metrics gets the same complaint, and routers need the names as they are.
    colon = " metric names should not contain ':'"
    assert all(p.endswith(colon) for p in problems), problems
    vllm_families = {x.split()[2] for x in served.busy.splitlines() if x.startswith("# TYPE vllm:")}
    assert {p.removesuffix(colon) for p in problems} == vllm_families
    assert rc != 0  # the colon lint is reported as a failure, as for vLLM
    rc, problems = _promtool(_without_vllm(served.busy))
    assert (rc, problems) == (0, [])


# -- vLLM's names ---------------------------------------------------------------------------------


def test_vllm_series_have_vllms_types_labels_and_buckets(served: Served) -> None:
    types = _types(served.idle)
    assert {n: types.get(n) for n in VLLM_TYPES} == VLLM_TYPES
    for fam in text_string_to_metric_families(served.idle):
        if not fam.name.startswith("vllm:"):
            continue
        for s in fam.samples:
            assert s.labels["model_name"] == served.stack.model and s.labels["engine"] == "0", s
        if fam.name in VLLM_BUCKETS:
            bounds = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")]
            assert bounds == [*(str(b) for b in VLLM_BUCKETS[fam.name]), "+Inf"], fam.name
    reasons = {s.labels["finished_reason"] for fam in text_string_to_metric_families(served.idle)
               if fam.name == "vllm:request_success" for s in fam.samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


@pytest.mark.parametrize("which", ["busy", "idle"])
def test_vllm_series_equal_superinfer_series_in_the_same_scrape(served: Served, which: str) -> None:
    text = getattr(served, which)
    m = _samples(text)
    labels = {"model_name": served.stack.model, "engine": "0"}
    for vllm, ours in VLLM_EQUALS.items():
        assert _value(m, vllm, **labels) == sum(_value(m, n, **ls) for n, ls in ours), vllm
    for reason in ("stop", "length", "abort", "error"):
        assert (_value(m, "vllm:request_success_total", finished_reason=reason, **labels)
                == _value(m, "superinfer_requests_total", status=reason)), reason
    for hist in VLLM_BUCKETS:
        ours = hist.replace("vllm:", "superinfer_")
        theirs = {(n.replace("vllm:", "superinfer_"), ls - frozenset(labels.items())): v
                  for (n, ls), v in m.items() if n.startswith(hist)}
        assert theirs == {k: v for k, v in m.items() if k[0].startswith(ours)}, hist
    if which == "busy":  # the gauges a router reads were compared while they moved
        assert _value(m, "vllm:num_requests_running", **labels) > 0
        assert _value(m, "vllm:num_requests_waiting", **labels) > 0
        assert 0 < _value(m, "vllm:kv_cache_usage_perc", **labels) <= 1
    else:
        assert _value(m, "vllm:generation_tokens_total", **labels) == STREAMS * MAX_TOKENS
        assert _value(m, "vllm:request_success_total", finished_reason="length",
                      **labels) == STREAMS
        assert _value(m, "vllm:num_preemptions_total", **labels) > 0
        assert _value(m, "vllm:time_to_first_token_seconds_count", **labels) == STREAMS
        # Every admission queried the prefix cache (hits: test_bench_serve's multi-turn run).
        assert _value(m, "vllm:prefix_cache_queries_total", **labels) > 0


# -- SuperInfer's own series ----------------------------------------------------------------------


def test_cumulative_values_are_counters_that_count_what_was_served(served: Served) -> None:
    types = _types(served.idle)
    assert not [n for n, t in types.items() if t not in ("counter", "gauge", "histogram")]
    for key, series in SCHEDULER_SERIES.items():
        if key not in TENANTS_ONLY | SPECULATIVE_ONLY:  # rendered by their own tests
            assert types[series.name] == series.kind, series.name
    m = _samples(served.idle)
    for name in ("rotations", "swap_out_blocks", "swap_in_blocks", "iterations", "transfers"):
        assert _value(m, f"superinfer_scheduler_{name}_total") > 0, name
    for direction in ("d2h", "h2d"):
        assert _value(m, "superinfer_scheduler_transfer_bytes_total", direction=direction) > 0
        assert _value(m, "superinfer_scheduler_kvmem_copy_seconds_total", direction=direction) > 0
    # Every request is judged once against its TTFT SLO, and every gap against its TBT SLO.
    assert sum(_value(m, "superinfer_slo_ttft_requests_total", outcome=o)
               for o in ("met", "missed")) == STREAMS
    assert sum(_value(m, "superinfer_slo_tbt_gaps_total", outcome=o)
               for o in ("met", "missed")) == STREAMS * (MAX_TOKENS - 1)
    assert _value(m, "superinfer_kv_usage_ratio", tier="device") == 0  # all freed


def test_bench_reads_every_scheduler_counter_by_its_key(served: Served) -> None:
    """`bench serve` records /metrics deltas by sample name; its readers ask by key."""
    m = _samples(served.stack.scrape())
    got = asyncio.run(scrape(f"{served.stack.http_url}/metrics"))
    assert got is not None
    for key, series in SCHEDULER_SERIES.items():
        if series.kind == COUNTER and key not in TENANTS_ONLY | SPECULATIVE_ONLY:
            want = _value(m, series.sample_name, **dict(series.labels))
            assert scheduler_stat(got, key) == want, key


def test_the_scheduler_sends_exactly_the_statistics_the_gateway_types() -> None:
    sent = set(SchedulerStats().as_dict()) | set(EngineStats().as_dict()) | set(LoopStats().as_dict())
    # Histograms travel flattened (<key>:bucket:<le>, <key>:sum, <key>:count).
    assert {series_key(k) for k in sent} == set(SCHEDULER_SERIES) - TENANTS_ONLY - SPECULATIVE_ONLY
    assert {series_key(k) for k in SpecStats(accepted_per_pos=[1]).counters()} == SPECULATIVE_ONLY
    for key, series in SCHEDULER_SERIES.items():
        # Prometheus' conventions: counters end in _total (prometheus_client adds it),
        # durations are in seconds, nothing else claims _total.
        assert series.sample_name.endswith("_total") == (series.kind == COUNTER), key
        assert not re.search(r"_s($|_)", series.name), key


def test_slo_counters_judge_each_request_against_its_own_slos() -> None:
    def request(ttft_s: float, tokens: list[float]) -> Request:
        req = Request("r", [1, 2], SamplingParams(max_tokens=8), arrival_time=0.0,
                      slo=SLO(ttft_s=ttft_s, tbt_s=0.1))
        for t in tokens:
            req.append_token(5, t)
        return req

    stats = LoopStats()
    stats.count_slo(request(2.0, [1.0, 1.05, 1.3, 1.35]), now=1.4)  # met; gaps ok, late, ok
    stats.count_slo(request(0.5, [1.0]), now=1.0)  # first token too late, no gap
    stats.count_slo(request(5.0, []), now=0.2)  # gone before its budget ran out: not judged
    stats.count_slo(request(5.0, []), now=6.0)  # no token within 5 s: missed
    c = stats.slo[""]  # no tenants file
    assert (c.slo_ttft_met, c.slo_ttft_missed) == (1, 2)
    assert (c.slo_tbt_met, c.slo_tbt_missed) == (2, 1)


# -- the Grafana dashboard ------------------------------------------------------------------------


_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery durations
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    return {m.group() for m in re.finditer(r"(?<![\w:$.])[A-Za-z_:][\w:]*", e)
            if not e[m.end():].lstrip().startswith("(") and m.group().lower() not in _NOT_METRICS}


def _dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"] if p["type"] != "row"
           for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert inner, var["query"]
            out.append((f"variable {var['name']!r}", inner.group(1)))
    return out


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$i"}[$__rate_interval])))'
        ' / on (x) group_left sum(rate(vllm:b_total{tier="d"}[1m])) > bool 0') == {
        "a_bucket", "vllm:b_total"}


def test_every_dashboard_query_names_series_the_server_exports(served: Served) -> None:
    exported = {name for name, _ in _samples(served.idle)}
    named: set[str] = set()
    for where, expr in _dashboard_queries():
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= exported, f"{where}: {sorted(names - exported)} not exported"
        named |= names
    # What the dashboard is for: SLO attainment, rotation and transfer activity, queue
    # lengths, and KV usage on both tiers.
    assert {"superinfer_slo_ttft_requests_total", "superinfer_slo_tbt_gaps_total",
            "superinfer_scheduler_rotations_total", "superinfer_scheduler_swap_in_blocks_total",
            "superinfer_scheduler_transfer_bytes_total", "superinfer_requests_waiting",
            "superinfer_requests_rotary", "superinfer_requests_running",
            "superinfer_kv_usage_ratio"} <= named
    assert {s.labels["tier"] for s in next(f for f in text_string_to_metric_families(served.idle)
                                           if f.name == "superinfer_kv_usage_ratio").samples
            } == {"device", "host"}


# -- a real Prometheus ----------------------------------------------------------------------------


def _prometheus(served: Served) -> Prometheus:
    if served.prometheus is None:
        pytest.skip(served.no_prometheus)
    return served.prometheus


def test_prometheus_reads_nonzero_rates_of_tokens_and_rotations(served: Served) -> None:
    prom = _prometheus(served)
    at = served.end + 1.0
    for expr in ["sum(rate(superinfer_generation_tokens_total[1m]))",
                 "sum(rate(superinfer_prompt_tokens_total[1m]))",
                 "sum(rate(vllm:generation_tokens_total[1m]))",
                 "sum(rate(superinfer_scheduler_rotations_total[1m]))",
                 "sum(rate(vllm:num_preemptions_total[1m]))",
                 # Running is nonzero for the whole load; waiting and rotary only while
                 # requests queue, which can fall between two 1 s scrapes (the busy
                 # scrape above checks those gauges while they move).
                 "max_over_time(vllm:num_requests_running[1m])",
                 "max_over_time(vllm:kv_cache_usage_perc[1m])"]:
        result = prom.query(expr, at)
        assert result and float(result[0]["value"][1]) > 0, (expr, result)


def test_every_dashboard_query_answers_in_prometheus(served: Served) -> None:
    prom = _prometheus(served)
    for where, expr in _dashboard_queries():
        concrete = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        assert prom.query(concrete, served.end + 1.0), f"{where}: {concrete} is empty"
