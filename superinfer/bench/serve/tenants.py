"""`bench serve --tenant ...`: several tenants at once, each with its own key and load.

Each `--tenant` names one tenant's traffic: its API key, rate, number of requests, lengths
and SLOs (the rest from the command line). Every tenant's trace is replayed at the same
time against the same server, each with its own bearer key, and the report has one row
per tenant: what the bench measured from its own side, beside what the server's `/metrics`
counted for that tenant over the same pass (its `tenant`-labelled SLO and goodput series).

The two sides count alike (the server's rules, `scheduler_svc/loop.py`): TTFT per request,
a request without a first token a miss; TBT per gap; goodput per completed request with
TTFT <= S_B and mean TPOT <= S_F. The bench leaves out requests the gateway refused (4xx:
the server never scheduled them) and reports them apart. The server measures from its
own arrival to its own first token, the bench from the send to the first streamed token,
so a request right at its SLO may land on different sides: `agree` says whether every
per-request count is within one request (TBT: within one request's gaps).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from dataclasses import dataclass
from typing import Any

from superinfer.bench.report import table
from superinfer.bench.serve.prompts import BodyOptions, Conversations, TextTokenizer, prompt_text
from superinfer.bench.serve.runner import BenchError, Target, metric_deltas, replay, scrape
from superinfer.bench.serve.stream import StreamOutcome
from superinfer.bench.serve.summary import result_row
from superinfer.workload import TraceRequest, WorkloadSpec, build_trace

_FIELDS = {"name", "key", "key-env", "rps", "num-prompts", "max-prompt-len", "max-output-len",
           "ttft-slo", "tbt-slo"}
TENANT_HELP = (
    "one tenant's traffic, repeatable: name=N,key-env=VAR (or key=K),rps=R,num-prompts=P"
    "[,max-prompt-len=L][,max-output-len=L][,ttft-slo=S][,tbt-slo=S] (unset: the flags'); "
    "every tenant's trace runs at once and the report has a row per tenant beside what "
    "/metrics counted for it")


@dataclass(frozen=True, slots=True)
class TenantLoad:
    name: str
    key: str
    rps: float
    num_prompts: int
    max_prompt_len: int
    max_output_len: int
    ttft_slo_s: float
    tbt_slo_s: float


def parse_tenant(text: str, args: argparse.Namespace) -> TenantLoad:
    """A --tenant value, with the command line's defaults; BenchError says what is wrong."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in _FIELDS:
            raise BenchError(f"--tenant {text!r}: {part!r} is not one of "
                             f"{', '.join(sorted(_FIELDS))} = value")
        fields[k] = v.strip()
    if "name" not in fields:
        raise BenchError(f"--tenant {text!r}: give name=...")
    if "key-env" in fields:
        key = os.environ.get(fields["key-env"], "")
        if not key:
            raise BenchError(f"--tenant {fields['name']}: ${fields['key-env']} is not set")
    else:
        key = fields.get("key", "")
    if not key:
        raise BenchError(f"--tenant {fields['name']}: give key-env=VAR (or key=...)")

    def num(name: str, default: float, cast: type = float) -> Any:
        try:
            v = cast(fields[name]) if name in fields else default
        except ValueError:
            raise BenchError(f"--tenant {fields['name']}: {name}={fields[name]!r} is not a "
                             f"{'whole ' if cast is int else ''}number") from None
        if not v > 0:
            raise BenchError(f"--tenant {fields['name']}: {name} must be positive, got {v}")
        return v

    rps = num("rps", args.rps)
    if math.isinf(rps):
        raise BenchError(f"--tenant {fields['name']}: give a finite rps=...")
    return TenantLoad(
        name=fields["name"], key=key, rps=rps,
        num_prompts=num("num-prompts", args.num_prompts or 20, int),
        max_prompt_len=num("max-prompt-len", args.max_prompt_len, int),
        max_output_len=num("max-output-len", args.max_output_len, int),
        ttft_slo_s=num("ttft-slo", args.ttft_slo), tbt_slo_s=num("tbt-slo", args.tbt_slo),
    )


@dataclass(slots=True)
class _Run:
    load: TenantLoad
    trace: list[TraceRequest]
    outcomes: list[StreamOutcome]
    start: float
    end: float


def run_tenants(args: argparse.Namespace, loads: list[TenantLoad], model: str,
                tok: TextTokenizer | None, metrics: str | None) -> list[dict[str, Any]]:
    """Every tenant's trace at once; one result row per tenant (printed as a table)."""
    names = [t.name for t in loads]
    if len(set(names)) != len(names):
        raise BenchError(f"--tenant names must differ, got {names}")
    traces = []
    for i, t in enumerate(loads):
        spec = WorkloadSpec(dataset=args.dataset, rps=t.rps, duration_s=None,
                            num_prompts=t.num_prompts, burstiness=args.burstiness,
                            seed=args.seed + 1000 * i, max_prompt_len=t.max_prompt_len,
                            max_output_len=t.max_output_len, length_scale=args.length_scale)
        traces.append(build_trace(spec, tok.encode if tok else None))

    async def everyone() -> tuple[dict[str, float] | None, list[_Run], dict[str, float] | None]:
        before = await scrape(metrics)
        jobs = []
        for i, (t, trace) in enumerate(zip(loads, traces, strict=True)):
            target = Target(args.base_url, args.endpoint, t.key, args.timeout,
                            args.max_concurrency)
            opts = BodyOptions(args.endpoint, model, args.temperature, args.ignore_eos,
                               t.ttft_slo_s, t.tbt_slo_s, "", args.max_tokens)
            texts = [prompt_text(r, args.seed + 1000 * i, tok) for r in trace]
            jobs.append(replay(target, trace, Conversations(len(trace), 1).bodies(trace, texts, opts)))
        done = await asyncio.gather(*jobs)
        runs = [_Run(t, trace, outcomes, start, end)
                for t, trace, (outcomes, start, end) in zip(loads, traces, done, strict=True)]
        return before, runs, await scrape(metrics)

    before, runs, after = asyncio.run(everyone())
    server = metric_deltas(before, after)
    rows = [tenant_row(r, server, args) for r in runs]
    print(format_tenants(rows), flush=True)
    for line in format_blame(rows):
        print(line)
    return rows


def tenant_row(run: _Run, server: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    t = run.load
    row = result_row(label=t.name, rps=t.rps, trace=run.trace, outcomes=run.outcomes,
                     ttft_slo_s=t.ttft_slo_s, tbt_slo_s=t.tbt_slo_s,
                     duration_s=run.trace[-1].arrival_s if run.trace else None,
                     start=run.start, end=run.end, server={})
    row["tenant"] = t.name
    row["refused"] = sum(1 for o in run.outcomes if o.http_status is not None
                         and 400 <= o.http_status < 500)
    bench = own_counts(run.outcomes, t.ttft_slo_s, t.tbt_slo_s)
    seen = server_counts(server, t.name)
    row["counts"] = {"bench": bench, "server": seen}
    row["blame_s"] = server_blame(server, t.name)
    if seen is None:
        row["agree"] = None
    else:
        gaps = max(t.max_output_len - 1, 1)
        row["agree"] = all(abs(bench[k] - seen[k]) <= (gaps if k.startswith("tbt") else 1)
                           for k in bench)
        row["server_ttft_attainment"] = _share(seen["ttft_met"], seen["ttft_missed"])
        row["server_tbt_attainment"] = _share(seen["tbt_met"], seen["tbt_missed"])
    return row


def own_counts(outcomes: list[StreamOutcome], ttft_slo_s: float, tbt_slo_s: float) -> dict[str, int]:
    """The server's counts, as the bench measured them (requests the gateway refused left
    out: they never reached the scheduler)."""
    c = {"ttft_met": 0, "ttft_missed": 0, "tbt_met": 0, "tbt_missed": 0, "good": 0}
    for o in outcomes:
        if o.http_status is not None and 400 <= o.http_status < 500:
            continue
        times = o.token_times()
        ttft_ok = bool(times) and times[0] - o.sent_at <= ttft_slo_s
        c["ttft_met" if ttft_ok else "ttft_missed"] += 1
        gaps = [b - a for a, b in zip(times, times[1:])]
        late = sum(1 for g in gaps if g > tbt_slo_s)
        c["tbt_missed"] += late
        c["tbt_met"] += len(gaps) - late
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        if o.ok and o.finish_reason in ("stop", "length") and ttft_ok and tpot <= tbt_slo_s:
            c["good"] += 1
    return c


def server_counts(delta: dict[str, float], tenant: str) -> dict[str, int] | None:
    """The same counts from the server's /metrics deltas for `tenant` (None: none)."""
    def get(name: str, outcome: str | None = None) -> float | None:
        labels = f"outcome={outcome},tenant={tenant}" if outcome else f"tenant={tenant}"
        return delta.get(f"{name}{{{labels}}}")

    values = {
        "ttft_met": get("superinfer_slo_ttft_requests_total", "met"),
        "ttft_missed": get("superinfer_slo_ttft_requests_total", "missed"),
        "tbt_met": get("superinfer_slo_tbt_gaps_total", "met"),
        "tbt_missed": get("superinfer_slo_tbt_gaps_total", "missed"),
        "good": get("superinfer_slo_good_requests_total"),
    }
    if all(v is None for v in values.values()):
        return None
    return {k: int(round(v or 0.0)) for k, v in values.items()}


def server_blame(delta: dict[str, float], tenant: str) -> dict[str, float]:
    """Seconds the tenant's missed intervals sat queued behind each tenant's requests on
    the device, as the server counted them over the pass (docs/metrics.md)."""
    prefix = "superinfer_slo_miss_blame_seconds_total{behind="
    out = {}
    for name, v in delta.items():
        if name.startswith(prefix) and name.endswith(f",tenant={tenant}}}") and v > 0:
            out[name[len(prefix):].split(",", 1)[0]] = v
    return out


def format_blame(rows: list[dict[str, Any]]) -> list[str]:
    """`interactive's misses: 70% waiting behind batch, 30% behind interactive`."""
    lines = []
    for r in rows:
        blame = r.get("blame_s") or {}
        total = sum(blame.values())
        if total > 0:
            parts = [f"{100 * s / total:.0f}% behind {who}" for who, s in
                     sorted(blame.items(), key=lambda kv: -kv[1])]
            lines.append(f"{r['tenant']}'s misses: {total:.1f} s queued, " + ", ".join(parts))
    return lines


def _share(met: int, missed: int) -> float | None:
    return met / (met + missed) if met + missed else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_tenants(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        b, s = r["counts"]["bench"], r["counts"]["server"]
        body.append([
            r["tenant"], f"{r['rps']:g}", r["requests"], r["refused"],
            _pct(_share(b["ttft_met"], b["ttft_missed"])), _pct(r.get("server_ttft_attainment")),
            _pct(_share(b["tbt_met"], b["tbt_missed"])), _pct(r.get("server_tbt_attainment")),
            f"{b['good']}", "-" if s is None else f"{s['good']}",
            "-" if r["p99_ttft_s"] is None else f"{r['p99_ttft_s']:.2f}",
            "-" if r["agree"] is None else ("yes" if r["agree"] else "NO"),
        ])
    return table(["tenant", "req/s", "requests", "refused", "TTFT bench", "TTFT server",
                  "TBT bench", "TBT server", "good bench", "good server", "p99 TTFT s",
                  "agree"], body)
