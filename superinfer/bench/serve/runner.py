"""Replaying a trace against a server: arrivals on schedule, streams side by side.

Each request is sent at its trace arrival time whether or not earlier ones are done
(an open-loop client, as `vllm bench serve`); `max_concurrency` caps the requests in
flight, and a request that waits for a slot is sent (and timed) when it gets one. Before
sending anything, `probe` asks GET /models so a wrong URL fails at once with a clear
message. The server's own Prometheus counters are read before and after a pass where
the server has them (SuperInfer's /metrics), so the results can show what the server
counted for the same requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from common.errors import SuperInferError
from superinfer.bench.serve.stream import StreamOutcome, error_body_message, send
from superinfer.workload import TraceRequest

PROBE_TIMEOUT_S = 10.0


class BenchError(SuperInferError):
    """The benchmark cannot run: server unreachable, bad answer, bad option."""

    code = "bench_error"


@dataclass(slots=True, frozen=True)
class Target:
    base_url: str  # ends in /v1 for OpenAI servers
    endpoint: str  # "completions" or "chat"
    api_key: str | None = None
    read_timeout_s: float | None = 600.0
    max_concurrency: int | None = None

    @property
    def path(self) -> str:
        return "/chat/completions" if self.endpoint == "chat" else "/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, max_connections: int | None = None) -> httpx.AsyncClient:
        # No proxies from the environment: a proxy in the path would be measured too.
        return httpx.AsyncClient(
            base_url=self.base_url.rstrip("/"), headers=self.headers(), trust_env=False,
            timeout=httpx.Timeout(PROBE_TIMEOUT_S, read=self.read_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
        )


async def probe(target: Target) -> list[str]:
    """The served model ids from GET /models, or BenchError saying what is wrong."""
    url = f"{target.base_url.rstrip('/')}/models"
    try:
        async with target.client() as c:
            r = await c.get("/models")
    except httpx.HTTPError as e:
        why = str(e) or type(e).__name__
        raise BenchError(
            f"cannot reach {url} ({why}); check --base-url, or start a server "
            "(`superinfer serve`)"
        ) from None
    if r.status_code != 200:
        hint = "check --base-url and --api-key"
        if r.status_code == 404 and not target.base_url.rstrip("/").endswith("/v1"):
            hint = "the base URL usually ends in /v1; " + hint
        raise BenchError(f"GET {url} answered {error_body_message(r.status_code, r.content)}; "
                         f"{hint}")
    try:
        data = r.json()["data"]
        return [str(m["id"]) for m in data]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"GET {url} did not return an OpenAI model list; check --base-url") from None


def metrics_url(base_url: str) -> str:
    """Where an OpenAI server at .../v1 usually exposes Prometheus metrics."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


async def scrape(url: str | None) -> dict[str, float] | None:
    """superinfer_* counters (the gateway's and the scheduler's) and the sums and counts of
    its histograms, or None where the server has none."""
    if not url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S) as c:
            r = await c.get(url)
        if r.status_code != 200:
            return None
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if not s.name.startswith("superinfer_"):
                    continue
                if not (fam.type == "counter" or (fam.type == "histogram" and
                                                  s.name.endswith(("_sum", "_count")))):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
        return out or None
    except (httpx.HTTPError, ValueError):
        return None


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    if before is None or after is None:
        return {}
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)}


async def replay(
    target: Target,
    trace: Sequence[TraceRequest],
    bodies: Sequence[dict[str, Any]],
    on_done: Callable[[StreamOutcome], None] | None = None,
    lead_s: float = 0.05,
) -> tuple[list[StreamOutcome], float, float]:
    """Send every request at its arrival; (outcomes in trace order, start, end) perf times."""
    run_id = uuid.uuid4().hex[:8]
    limit = target.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    headers = target.headers()
    async with target.client(max_connections=limit) as client:
        start = time.perf_counter() + lead_s

        async def one(req: TraceRequest, body: dict[str, Any]) -> StreamOutcome:
            out = StreamOutcome(index=req.index, scheduled_s=req.arrival_s)
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            h = {**headers, "X-Request-ID": f"bench-{run_id}-{req.index}"}
            async with sem or contextlib.nullcontext():
                await send(client, target.path, body, out, target.endpoint, h)
            if on_done is not None:
                on_done(out)
            return out

        outcomes = await asyncio.gather(*(one(r, b) for r, b in zip(trace, bodies, strict=True)))
    return list(outcomes), start, time.perf_counter()


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """tqdm on stderr, off when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False,
                disable=not (enabled and sys.stderr.isatty()))
