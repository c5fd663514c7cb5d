"""`superinfer bench serve --speculative`: speculation on and off, in one run, on
input-grounded prompts and on open chat, at each concurrency.

The workload is the committed prompt set `data/spec_prompts.jsonl` (or `--dataset` a
file of the same shape): chat messages per line, each of a kind — rewrite or correct a
given passage, edit given code, extract fields from a text, a multi-turn conversation whose
answer quotes earlier turns (together: input-grounded), and open chat, the control. Every
request is greedy (temperature 0) and stops where the model does (at most its
`max_tokens`).

The server runs with `--speculative-config`; a request with `"speculative": false` does
not speculate, so the two sides share the server, the machine and the minute. A pass
sends one kind's prompts at most c at a time (c streams), on one side; every repeat runs
each kind and concurrency on both sides back to back, the order alternating between
repeats. Per pass: output tokens (usage) over its wall time, and the deltas of vLLM's
spec-decode counters on /metrics (acceptance per kind). Per workload and concurrency:
tok/s on and off (sum of tokens over sum of pass times, per repeat, median over repeats),
the speedup (median of the per-repeat ratios), the acceptance rate, and `exact`: the
prompts whose text was the same on and off (in every repeat).

`--baseline-url` (and `--baseline-off-url`): llama.cpp's server with its own draft-free
speculation (`--spec-type ngram-...`) and without, measured on the same passes as the
anchor (their ratio is its speedup from lookup on this machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics as st
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from superinfer.bench.serve.baseline import _models, cpu_info
from superinfer.bench.serve.runner import (
    BenchError,
    Target,
    metric_deltas,
    metrics_url,
    replay,
    scrape,
)
from superinfer.workload import TraceRequest

GROUNDED = ("rewrite", "code-edit", "extract", "multi-turn")
OPEN = "open-chat"
WORKLOADS = {"input-grounded": GROUNDED, "open-chat": (OPEN,)}
# The scheduler's spec-decode counters as `scrape` reads them (vLLM's, under SuperInfer's
# prefix: gateway/metrics.py).
ACCEPTED = "superinfer_scheduler_spec_decode_accepted_tokens_total"
DRAFTS = "superinfer_scheduler_spec_decode_draft_tokens_total"


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    kind: str
    messages: list[dict[str, str]]
    max_tokens: int


def load_prompts(path: str | None) -> list[Prompt]:
    """The committed set (None) or a file of the same shape."""
    if path is None:
        text = resources.files("superinfer.bench.serve").joinpath(
            "data/spec_prompts.jsonl").read_text()
    else:
        text = Path(path).read_text()
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Prompt(row["id"], row["kind"], row["messages"], int(row["max_tokens"])))
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(f"{path or 'spec_prompts.jsonl'} line {n}: needs id, kind, "
                             f"messages and max_tokens ({e})") from None
    kinds = {p.kind for p in out}
    if not kinds & set(GROUNDED) or OPEN not in kinds:
        raise BenchError(f"the prompt set needs input-grounded kinds ({', '.join(GROUNDED)}) "
                         f"and {OPEN}; it has {', '.join(sorted(kinds))}")
    return out


@dataclass(slots=True)
class Side:
    label: str
    target: Target
    model: str
    extra: dict[str, Any]  # more body fields ({"speculative": ...} for SuperInfer)
    metrics: str | None  # its /metrics (SuperInfer's: spec-decode counters)


def _pass(side: Side, prompts: Sequence[Prompt], c: int) -> dict[str, Any]:
    t = side.target
    limited = Target(t.base_url, "chat", t.api_key, t.read_timeout_s, c)
    trace = [TraceRequest(i, 0.0, 0, p.max_tokens) for i, p in enumerate(prompts)]
    bodies = [{"model": side.model, "messages": p.messages, "max_tokens": p.max_tokens,
               "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
               **side.extra} for p in prompts]
    before = asyncio.run(scrape(side.metrics))
    outcomes, start, end = asyncio.run(replay(limited, trace, bodies))
    delta = metric_deltas(before, asyncio.run(scrape(side.metrics)))
    tokens = sum(o.output_tokens or 0 for o in outcomes if o.ok)
    last = max((o.done_at or end for o in outcomes), default=end)
    return {
        "tokens": tokens, "seconds": last - start,
        "failed": sum(not o.ok for o in outcomes),
        "first_error": next((o.error for o in outcomes if o.error), None),
        "draft_tokens": delta.get(DRAFTS, 0.0), "accepted_tokens": delta.get(ACCEPTED, 0.0),
        "texts": {p.id: o.text for p, o in zip(prompts, outcomes, strict=True)},
    }


def run_speculative(args: Any) -> int:
    prompts = load_prompts(args.dataset if args.dataset != "sharegpt" else None)
    ours = Target(args.base_url, "chat", args.api_key, args.timeout)
    model = asyncio.run(_models(ours, args.model))
    murl = None if args.metrics_url == "none" else (args.metrics_url or metrics_url(args.base_url))
    sides = [Side("off", ours, model, {"speculative": False}, murl),
             Side("on", ours, model, {"speculative": True}, murl)]
    anchors: list[Side] = []
    for url, label in ((args.baseline_url, args.baseline_label),
                       (getattr(args, "baseline_off_url", None), f"{args.baseline_label}-off")):
        if url:
            t = Target(url, "chat", args.baseline_api_key, args.timeout)
            anchors.append(Side(label, t, asyncio.run(_models(t, args.baseline_model)), {}, None))
    kinds = sorted({p.kind for p in prompts}, key=lambda k: (k == OPEN, k))
    by_kind = {k: [p for p in prompts if p.kind == k] for k in kinds}
    load_before = os.getloadavg()
    for side in sides + anchors:  # warm-up: thread pools, the tuner's first picks
        _pass(side, by_kind[kinds[0]][:2], 1)
    passes: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for c in args.streams:
            for kind in kinds:
                order = sides + anchors if rep % 2 == 0 else list(reversed(sides + anchors))
                for side in order:
                    m = _pass(side, by_kind[kind], c)
                    passes.append({"repeat": rep, "streams": c, "kind": kind,
                                   "side": side.label, **m})
                    tok_s = m["tokens"] / m["seconds"] if m["seconds"] > 0 else 0.0
                    acc = (f", acceptance {m['accepted_tokens'] / m['draft_tokens']:.2f}"
                           if m["draft_tokens"] else "")
                    print(f"  repeat {rep + 1}/{args.repeats} {c:2d} streams {kind:>10s} "
                          f"{side.label:>14s}: {tok_s:6.1f} tok/s{acc}"
                          + (f", {m['failed']} failed ({m['first_error']})"
                             if m["failed"] else ""), file=sys.stderr, flush=True)
    results = summarize(passes, args.streams, kinds, [a.label for a in anchors])
    print(format_table(results, args.streams, [a.label for a in anchors]))
    config = {"base_url": args.base_url, "model": model, "streams": args.streams,
              "repeats": args.repeats, "prompts": len(prompts),
              "kinds": {k: len(v) for k, v in by_kind.items()},
              "anchors": {a.label: a.target.base_url for a in anchors},
              "cpu": cpu_info(), "note": args.note,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        for p in passes:
            p.pop("texts")
        Path(args.json).write_text(json.dumps(
            {"config": config, "results": results, "passes": passes}, indent=1))
        print(f"wrote {args.json}")
    if any(p["failed"] for p in passes):
        first = next(p["first_error"] for p in passes if p["failed"])
        print(f"superinfer bench serve: some requests failed; the first: {first}",
              file=sys.stderr)
        return 1
    return 0


def _rate(ps: list[dict[str, Any]]) -> float | None:
    secs = sum(p["seconds"] for p in ps)
    return sum(p["tokens"] for p in ps) / secs if secs > 0 else None


def summarize(passes: list[dict[str, Any]], streams: Sequence[int], kinds: Sequence[str],
              anchors: Sequence[str]) -> dict[str, Any]:
    """Per workload and concurrency: tok/s on and off, speedup, acceptance, exactness;
    per kind: acceptance; the anchors' tok/s and their ratio."""
    out: dict[str, Any] = {}
    reps = sorted({p["repeat"] for p in passes})
    for name, members in WORKLOADS.items():
        ks = [k for k in kinds if k in members]
        if not ks:
            continue
        for c in streams:
            def sel(side: str, rep: int, c: int = c, ks: list[str] = ks) -> list[dict[str, Any]]:
                return [p for p in passes if p["side"] == side and p["repeat"] == rep
                        and p["streams"] == c and p["kind"] in ks]

            on = [_rate(sel("on", r)) for r in reps]
            off = [_rate(sel("off", r)) for r in reps]
            ratios = [a / b for a, b in zip(on, off, strict=True) if a and b]
            drafted = sum(p["draft_tokens"] for r in reps for p in sel("on", r))
            accepted = sum(p["accepted_tokens"] for r in reps for p in sel("on", r))
            same, total = 0, 0
            for r in reps:
                a_texts = {k: v for p in sel("off", r) for k, v in p["texts"].items()}
                b_texts = {k: v for p in sel("on", r) for k, v in p["texts"].items()}
                same += sum(a_texts[k] == b_texts.get(k) for k in a_texts)
                total += len(a_texts)
            row: dict[str, Any] = {
                "tok_s_on": _median(on), "tok_s_off": _median(off),
                "speedup": _median(ratios),
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "exact": {"count": same, "total": total},
                "per_kind_acceptance": {},
            }
            for k in ks:
                d = sum(p["draft_tokens"] for r in reps for p in sel("on", r, ks=[k]))
                a = sum(p["accepted_tokens"] for r in reps for p in sel("on", r, ks=[k]))
                row["per_kind_acceptance"][k] = a / d if d else 0.0
            if anchors:
                lookup = [_rate(sel(anchors[0], r)) for r in reps]
                row["anchor_tok_s"] = _median(lookup)
                if len(anchors) > 1:
                    plain = [_rate(sel(anchors[1], r)) for r in reps]
                    row["anchor_off_tok_s"] = _median(plain)
                    row["anchor_speedup"] = _median(
                        [a / b for a, b in zip(lookup, plain, strict=True) if a and b])
            out[f"{name}@{c}"] = row
    return out


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return st.median(vals) if vals else None


def _f(v: float | None, d: int) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def format_table(results: dict[str, Any], streams: Sequence[int], anchors: Sequence[str]) -> str:
    head = (f"{'workload':>15s} {'streams':>7s} {'tok/s off':>9s} {'tok/s on':>9s} "
            f"{'speedup':>7s} {'accept':>6s} {'exact':>7s}")
    if anchors:
        head += f" {anchors[0] + ' tok/s':>16s}"
        if len(anchors) > 1:
            head += f" {'its speedup':>11s}"
    lines = [head]
    for key, r in results.items():
        name, c = key.split("@")
        line = (f"{name:>15s} {c:>7s} {_f(r['tok_s_off'], 1):>9s} {_f(r['tok_s_on'], 1):>9s} "
                f"{_f(r['speedup'], 2):>7s} {r['acceptance_rate']:6.2f} "
                f"{r['exact']['count']:>3d}/{r['exact']['total']:<3d}")
        if anchors:
            line += f" {_f(r.get('anchor_tok_s'), 1):>16s}"
            if len(anchors) > 1:
                line += f" {_f(r.get('anchor_speedup'), 2):>11s}"
        lines.append(line)
    for key, r in results.items():
        if len(r["per_kind_acceptance"]) > 1:
            name, c = key.split("@")
            lines.append(f"acceptance per kind, {name} at {c} streams: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["per_kind_acceptance"].items()))
    return "\n".join(lines)
