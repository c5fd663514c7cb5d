"""Replaying a trace against a server: arrivals on schedule, streams side by side.

Each request is sent at its trace arrival time whether or not earlier ones are done
(an open-loop client, as `vllm bench serve`); `max_concurrency` caps the requests in
flight, and a request that waits for a slot is sent (and timed) when it gets one. In a
multi-turn run a turn needs its conversation's previous reply: it is sent at its arrival
or `think_s` after that reply ended, whichever is later (and timed from then). Before
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
    its histograms, or None where the server has none. Several URLs, comma-separated (the
    replicas behind a router): their values summed."""
    if not url:
        return None
    if "," in url:
        parts = [await scrape(u.strip()) for u in url.split(",") if u.strip()]
        if any(p is None for p in parts):
            return None
        total: dict[str, float] = {}
        for p in parts:
            for k, v in (p or {}).items():
                total[k] = total.get(k, 0.0) + v
        return total
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


# The body of trace position i, made when it is sent from the outcomes so far (a turn
# of a conversation carries the replies before it).
BodyMaker = Callable[[int, Sequence[StreamOutcome]], dict[str, Any]]


async def replay(
    target: Target,
    trace: Sequence[TraceRequest],
    bodies: Sequence[dict[str, Any]] | BodyMaker,
    on_done: Callable[[StreamOutcome], None] | None = None,
    lead_s: float = 0.05,
    after: Callable[[int], int | None] | None = None,
    think_s: float = 0.0,
) -> tuple[list[StreamOutcome], float, float]:
    """Send every request at its arrival; (outcomes in trace order, start, end) perf times.

    `after(i)`: the trace position whose reply request i waits for (None: none), then
    `think_s` more."""
    run_id = uuid.uuid4().hex[:8]
    limit = target.max_concurrency
    sem = asyncio.Semaphore(limit) if limit else None
    headers = target.headers()
    outcomes = [StreamOutcome(index=r.index, scheduled_s=r.arrival_s) for r in trace]
    done = [asyncio.Event() for _ in trace]
    async with target.client(max_connections=limit) as client:
        start = time.perf_counter() + lead_s

        async def one(i: int, req: TraceRequest) -> StreamOutcome:
            out = outcomes[i]
            prev = after(i) if after is not None else None
            try:
                delay = start + req.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if prev is not None:
                    await done[prev].wait()
                    end = outcomes[prev].done_at or time.perf_counter()
                    if (wait := end + think_s - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    # When it was due: a later send than this is the client's lag.
                    out.scheduled_s = max(req.arrival_s, end + think_s - start)
                body = bodies(i, outcomes) if callable(bodies) else bodies[i]
                h = {**headers, "X-Request-ID": f"bench-{run_id}-{req.index}"}
                async with sem or contextlib.nullcontext():
                    await send(client, target.path, body, out, target.endpoint, h)
            finally:
                done[i].set()
            if on_done is not None:
                on_done(out)
            return out

        await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    return outcomes, start, time.perf_counter()


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """tqdm on stderr, off when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False,
                disable=not (enabled and sys.stderr.isatty()))
