"""`python -m experiments pipeline`: how busy the worker is, with the pipelined step and without.

The same workload twice — N concurrent greedy streams through the gateway, a device pool
small enough that LVF rotates — once with the default (pipelined) step and once with
`--no-pipeline`, each against a fresh stack started with `--trace`. From each trace: the
worker's compute (the `compute_s` of the execute spans) as a share of the wall time from
the measured run's first batch to its last (the warm-up before it, and the pause between
the two when no request exists, are left out; `incl. warm-up` is the share over every
batch in the trace), the idle time between batches and how much of it a transfer wait
covered, and what the scheduler waited on per iteration. Prints a table and writes JSON
(`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.overhead import CLIENTS, _served_once, _start_stack
from scheduler_svc.trace import clock_origin, load_trace
from superinfer.bench.engine import PROMPTS
from superinfer.bench.report import table, write_json

MODES = {"pipelined": [], "serial": ["--no-pipeline"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per stream")
    p.add_argument("--device-blocks", type=int, default=200,
                   help="device pool (small: LVF rotates)")
    p.add_argument("--host-blocks", type=int, default=4096, help="host pool (rotation space)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode (medians reported)")
    p.add_argument("--modes", default="pipelined,serial")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--keep-traces", default=None, metavar="DIR",
                   help="copy each mode's trace here (open them in ui.perfetto.dev)")
    p.add_argument("--client", choices=CLIENTS, default="lean",
                   help="the streaming client (see the overhead study's --client)")
    p.add_argument("--json", default=None)


def covered(a: float, b: float, by: list[dict[str, Any]]) -> float:
    """Seconds of the trace interval [a, b] (µs) that the spans `by` cover."""
    return sum(max(0.0, min(b, w["ts"] + w["dur"]) - max(a, w["ts"])) for w in by) / 1e6


def compute_share(events: list[dict[str, Any]], since: float | None = None) -> dict[str, float]:
    """From a scheduler trace: the worker's compute over the span of its batches.

    `since` (the scheduler's clock, time.monotonic()): count only the batches that started
    after it — the measured run, without the warm-up before it and the pause between the
    two, when the worker has no request at all. None: every batch in the trace.
    """
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "execute"),
                   key=lambda e: e["ts"])
    if since is not None:
        origin = clock_origin(events)
        if origin is None:
            raise ValueError("the trace does not say where its clock starts (clock_origin_s)")
        spans = [e for e in spans if e["ts"] / 1e6 >= since - origin]
    if not spans:
        raise ValueError("the trace has no execute spans")
    compute = sum(float(e["args"]["compute_s"]) for e in spans)
    start = spans[0]["ts"] / 1e6
    end = max(e["ts"] + e["dur"] for e in spans) / 1e6
    sched = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("iteration")
             and e["ts"] / 1e6 >= start]
    waits = [e for e in events if e.get("ph") == "X" and e.get("name") == "transfer wait"
             and e["ts"] / 1e6 >= start]
    # Where the worker idled: the gaps between one batch's end and the next one's start,
    # and how much of them a transfer wait covered (the step held the next batch back).
    gaps = [(a["ts"] + a["dur"], b["ts"]) for a, b in zip(spans, spans[1:], strict=False)]
    held = sum(covered(a, b, waits) for a, b in gaps if b > a)
    return {
        "batches": float(len(spans)),
        "wall_s": end - start,
        "compute_s": compute,
        "compute_share": compute / (end - start) if end > start else 0.0,
        "mean_batch_ms": 1e3 * compute / len(spans),
        "mean_schedule_ms": 1e3 * statistics.fmean(e["dur"] / 1e6 for e in sched) if sched else 0.0,
        "transfer_wait_s": sum(e["dur"] / 1e6 for e in waits),
        "idle_between_batches_s": end - start - compute,
        "idle_in_transfer_wait_s": held,
        "longest_gap_ms": 1e3 * max((max(0.0, b - a) for a, b in gaps), default=0.0) / 1e6,
    }


def _one(mode: str, args: argparse.Namespace, prompts: list[str], trace_dir: Path) -> dict[str, Any]:
    trace = trace_dir / f"{mode}.json"
    with tempfile.TemporaryDirectory(prefix=f"superinfer-pipeline-{mode}-") as d:
        sup, url = _start_stack(Path(d), args.device_blocks, args.startup_timeout,
                                scheduler_args=[*MODES[mode], "--trace", str(trace),
                                                "--no-enable-prefix-caching"],  # same prompts
                                host_blocks=args.host_blocks)
        try:
            asyncio.run(_served_once(url, prompts[:2], 4, args.client))  # warm-up (traced too)
            measured = time.monotonic()  # the scheduler's trace clock (system-wide)
            served = asyncio.run(_served_once(url, prompts, args.max_tokens, args.client))
        finally:
            sup.stop_all()  # the scheduler closes its trace on the way out
    events = load_trace(trace)
    share = compute_share(events, since=measured)
    whole = compute_share(events)  # the warm-up and the pause after it included
    return {"mode": mode, **share, "compute_share_with_warmup": whole["compute_share"],
            "decode_tok_s": served.decode_tok_s, "mean_ttft_s": served.mean_ttft_s,
            "new_tokens": served.new_tokens}


def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.requests < 1 or args.max_tokens < 2 or args.repeats < 1:
        print(f"superinfer: error: modes are {', '.join(MODES)}; need --requests >= 1, "
              "--max-tokens >= 2, --repeats >= 1", file=sys.stderr)
        return 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="superinfer-pipeline-traces-") as d:
        trace_dir = Path(args.keep_traces) if args.keep_traces else Path(d)
        trace_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(args.repeats):
            for mode in modes:  # interleaved: both modes see the same machine, in turn
                print(f"== {mode}", file=sys.stderr, flush=True)
                runs[mode].append(_one(mode, args, prompts, trace_dir))
    keys = ["compute_share", "compute_share_with_warmup", "mean_batch_ms", "mean_schedule_ms",
            "transfer_wait_s", "idle_between_batches_s", "idle_in_transfer_wait_s",
            "longest_gap_ms", "decode_tok_s", "mean_ttft_s", "batches"]
    rows = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in runs.items()}
    print(table(["step", "worker compute share", "incl. warm-up", "batch ms", "schedule ms",
                 "transfer wait s", "idle s", "idle in wait s", "longest gap ms",
                 "decode tok/s", "mean TTFT s", "batches"],
                [[m, f"{100 * r['compute_share']:.1f} %",
                  f"{100 * r['compute_share_with_warmup']:.1f} %", r["mean_batch_ms"],
                  r["mean_schedule_ms"], r["transfer_wait_s"], r["idle_between_batches_s"],
                  r["idle_in_transfer_wait_s"], r["longest_gap_ms"], r["decode_tok_s"],
                  r["mean_ttft_s"], int(r["batches"])] for m, r in rows.items()]))
    write_json(args.json, {
        "workload": {"requests": args.requests, "max_tokens": args.max_tokens,
                     "device_blocks": args.device_blocks, "repeats": args.repeats,
                     "client": args.client},
        "medians": rows, "runs": runs,
    })
    return 0
