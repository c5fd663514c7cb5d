"""`superinfer bench serve --baseline-url URL`: the same streamed workload against two
OpenAI-compatible servers (SuperInfer's gateway and, e.g., llama.cpp's llama-server) at
several concurrencies, in one run, interleaved, with the ratio.

Per concurrency c, a pass sends c x `--requests-per-stream` requests, at most c in flight
(c concurrent streams), each a synthetic prompt of `--prompt-len` tokens (uniform in the
range; texts no earlier pass sent, so no prefix cache answers them; the same texts for
both servers) asking for exactly `--output-len` greedy tokens
(``ignore_eos``). Every repeat runs each concurrency on both servers back to back, the
order alternating between repeats, so drift in the machine's load hits both alike. What
a pass reports:

* ``tok_s``: output tokens / (last token - first send), the pass's throughput;
* ``itl_ms``: the median gap between consecutive tokens of a stream (all streams pooled);
* ``ttft_s``: the mean time from a request's send to its first token.

The result per concurrency is the median over repeats of each server's values, and the
median of the per-repeat ratios (ours / baseline; > 1 is better for tok/s, < 1 for ITL
and TTFT).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics as st
import sys
from pathlib import Path
from typing import Any

import numpy as np

from superinfer.bench.serve.prompts import (
    BodyOptions,
    TextTokenizer,
    request_body,
    synthetic_prompt,
)
from superinfer.bench.serve.runner import BenchError, Target, probe, replay
from superinfer.bench.serve.stream import StreamOutcome
from superinfer.workload import TraceRequest

METRICS = ("tok_s", "itl_ms", "ttft_s")


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise BenchError(f"--prompt-len must be N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def pass_metrics(outcomes: list[StreamOutcome], start: float, end: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    times = [o.token_times() for o in ok]
    tokens = sum(len(t) for t in times)
    last = max((t[-1] for t in times if t), default=end)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    ttfts = [t[0] - o.sent_at for o, t in zip(ok, times) if t]
    return {
        "requests": len(outcomes), "failed": len(outcomes) - len(ok), "output_tokens": tokens,
        "tok_s": tokens / (last - start) if last > start else None,
        "itl_ms": st.median(gaps) * 1e3 if gaps else None,
        "ttft_s": st.mean(ttfts) if ttfts else None,
        "duration_s": last - start,
        "first_error": next((o.error for o in outcomes if o.error), None),
    }


def cpu_info() -> dict[str, Any]:
    """The CPU model and the flags that decide which kernels run."""
    model, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"model": model or platform.processor(), "cores": os.cpu_count(), "flags": keep}


async def _models(target: Target, want: str | None) -> str:
    models = await probe(target)
    model = want or (models[0] if models else None)
    if model is None:
        raise BenchError(f"{target.base_url}/models lists no model; pass the model name")
    return model


def run_baseline(args: Any, tok: TextTokenizer | None) -> int:
    ours = Target(args.base_url, args.endpoint, args.api_key, args.timeout)
    base = Target(args.baseline_url, args.endpoint, args.baseline_api_key, args.timeout)
    models = {"ours": asyncio.run(_models(ours, args.model)),
              "baseline": asyncio.run(_models(base, args.baseline_model))}
    labels = {"ours": args.label or "superinfer", "baseline": args.baseline_label}
    streams = args.streams
    lo, hi = parse_range(args.prompt_len)
    targets = {"ours": ours, "baseline": base}
    # Every pass gets prompts no earlier pass sent (neither server may answer from a
    # prefix cache); both servers get the same ones in the same repeat.
    offsets: dict[tuple[int, int], int] = {}

    def prompts(rep: int, c: int) -> list[tuple[int, str]]:
        n = c * args.requests_per_stream
        first = offsets.setdefault((rep, c), sum(k[1] for k in offsets) * args.requests_per_stream)
        out = []
        for i in range(first, first + n):
            plen = int(np.random.default_rng([args.seed, i]).integers(lo, hi + 1))
            out.append((plen, synthetic_prompt(plen, i, args.seed, tok)))
        return out

    def one_pass(side: str, c: int, rep: int) -> dict[str, Any]:
        ps = prompts(rep, c)
        trace = [TraceRequest(i, 0.0, plen, args.output_len) for i, (plen, _) in enumerate(ps)]
        opts = BodyOptions(args.endpoint, models[side], 0.0, True)
        bodies = [request_body(r, ps[r.index][1], opts) for r in trace]
        t = targets[side]
        limited = Target(t.base_url, t.endpoint, t.api_key, t.read_timeout_s, c)
        outcomes, start, end = asyncio.run(replay(limited, trace, bodies))
        return pass_metrics(outcomes, start, end)

    # a short warm-up on each (first-use costs: thread pools, caches, a tuner's first picks)
    load_before = os.getloadavg()
    for side in targets:
        one_pass(side, min(streams), -1)
    passes: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for c in streams:
            order = ("ours", "baseline") if rep % 2 == 0 else ("baseline", "ours")
            for side in order:
                m = one_pass(side, c, rep)
                passes.append({"repeat": rep, "streams": c, "side": side, **m})
                print(f"  repeat {rep + 1}/{args.repeats}  {c:3d} streams  {labels[side]:>12s}: "
                      f"{_f(m['tok_s'], 1)} tok/s, ITL {_f(m['itl_ms'], 1)} ms, "
                      f"TTFT {_f(m['ttft_s'], 2)} s"
                      + (f", {m['failed']} failed ({m['first_error']})" if m["failed"] else ""),
                      file=sys.stderr, flush=True)
    summary = summarize(passes, streams)
    print(format_table(summary, labels))
    config = {
        "base_url": args.base_url, "baseline_url": args.baseline_url, "labels": labels,
        "models": models, "endpoint": args.endpoint, "streams": streams,
        "requests_per_stream": args.requests_per_stream, "repeats": args.repeats,
        "prompt_len": [lo, hi], "output_len": args.output_len, "seed": args.seed,
        "cpu": cpu_info(), "note": args.note,
        # other processes on the machine: the ratio is what counts, but say how busy it was
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"config": config, "summary": summary, "passes": passes}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot(summary, labels, args.plot, f"{config['cpu']['model']} ({config['cpu']['cores']} "
             f"cores), {args.output_len} tokens per request")
        print(f"wrote {args.plot}")
    if any(p["failed"] for p in passes):
        first = next(p["first_error"] for p in passes if p["failed"])
        print(f"superinfer bench serve: some requests failed; the first: {first}", file=sys.stderr)
        return 1
    return 0


def summarize(passes: list[dict[str, Any]], streams: list[int]) -> list[dict[str, Any]]:
    rows = []
    for c in streams:
        row: dict[str, Any] = {"streams": c}
        reps = sorted({p["repeat"] for p in passes if p["streams"] == c})
        for side in ("ours", "baseline"):
            got = [p for p in passes if p["streams"] == c and p["side"] == side]
            row[side] = {k: _median([p[k] for p in got]) for k in METRICS}
        for k in METRICS:
            ratios = []
            for r in reps:
                a = next(p[k] for p in passes if (p["streams"], p["side"], p["repeat"]) == (c, "ours", r))
                b = next(p[k] for p in passes if (p["streams"], p["side"], p["repeat"]) == (c, "baseline", r))
                if a is not None and b:
                    ratios.append(a / b)
            row[f"{k}_ratio"] = _median(ratios)
        rows.append(row)
    return rows


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return st.median(xs) if xs else None


def _f(v: float | None, d: int) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def format_table(summary: list[dict[str, Any]], labels: dict[str, str]) -> str:
    a, b = labels["ours"], labels["baseline"]
    lines = [f"| streams | {a} tok/s | {a} ITL ms | {a} TTFT s | {b} tok/s | {b} ITL ms | "
             f"{b} TTFT s | tok/s ratio | ITL ratio | TTFT ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        o, s = r["ours"], r["baseline"]
        lines.append(
            f"| {r['streams']} | {_f(o['tok_s'], 1)} | {_f(o['itl_ms'], 1)} | {_f(o['ttft_s'], 2)} "
            f"| {_f(s['tok_s'], 1)} | {_f(s['itl_ms'], 1)} | {_f(s['ttft_s'], 2)} "
            f"| {_f(r['tok_s_ratio'], 2)}x | {_f(r['itl_ms_ratio'], 2)}x "
            f"| {_f(r['ttft_s_ratio'], 2)}x |")
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], labels: dict[str, str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = np.arange(len(summary))
    for ax, (k, name) in zip(axes, (("tok_s", "output tok/s"), ("itl_ms", "median ITL (ms)"),
                                    ("ttft_s", "mean TTFT (s)"))):
        for j, side in enumerate(("ours", "baseline")):
            vals = [r[side][k] or 0.0 for r in summary]
            ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=labels[side])
        for i, r in enumerate(summary):
            if r[f"{k}_ratio"] is not None:
                top = max(r["ours"][k] or 0.0, r["baseline"][k] or 0.0)
                ax.annotate(f"{r[f'{k}_ratio']:.2f}x", (i, top), ha="center", va="bottom")
        ax.set_xticks(x, [str(r["streams"]) for r in summary])
        ax.set_xlabel("concurrent streams")
        ax.set_title(name)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
