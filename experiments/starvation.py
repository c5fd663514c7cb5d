"""`python -m experiments starvation`: who misses their SLOs in the simulator, and for how long.

`superinfer sim` reports DESIGN §8's metrics: TTFT attainment per request and TBT
attainment per *gap*. A request swapped out for 70 s is one missed gap, as is one swapped
out for 0.2 s. This script runs the same simulations (same flags as `superinfer sim`) and
splits the misses up: which requests miss TTFT (prompt sizes, how many get their first
token only after arrivals stop, i.e. waited for the drain), and how long the missed gaps
last in total (stall seconds), the longest one, and per-request TPOT attainment.

    python -m experiments starvation --hardware gh200-96gb --model qwen2.5-32b \
        --dataset sharegpt --duration 120 --rps 14,20 \
        --policies lvf,swapped-first,waiting-first --json .experiments/starvation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from superinfer.sim import cli
from superinfer.sim.engine import PolicyVariant, simulate
from superinfer.sim.profile import load_hardware, load_model
from superinfer.slo_metrics import RequestRecord
from superinfer.workload import build_trace

LONG_PROMPT = 256  # tokens: ~the ShareGPT-like trace's 80th percentile


def breakdown(records: list[RequestRecord], arrivals_end_s: float) -> dict[str, Any]:
    def missed_ttft(r: RequestRecord) -> bool:
        return r.ttft_s is None or r.ttft_s > r.ttft_slo_s

    miss = [r for r in records if missed_ttft(r)]
    hit = [r for r in records if not missed_ttft(r)]
    drained = [r for r in miss if not r.token_times or r.token_times[0] > arrivals_end_s]
    gaps = [(g, r.tbt_slo_s) for r in records for g in r.gaps()]
    missed = [g for g, slo in gaps if g > slo]

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {
        "requests": len(records),
        "ttft_misses": len(miss),
        "ttft_misses_long_prompt": sum(r.prompt_tokens >= LONG_PROMPT for r in miss),
        "long_prompt_requests": sum(r.prompt_tokens >= LONG_PROMPT for r in records),
        "median_prompt_miss": median([r.prompt_tokens for r in miss]),
        "median_prompt_hit": median([r.prompt_tokens for r in hit]),
        "ttft_misses_after_arrivals_end": len(drained),
        "gaps": len(gaps),
        "missed_gaps": len(missed),
        "stall_s": sum(missed),
        "max_gap_s": max((g for g, _ in gaps), default=0.0),
    }


def run_one(args: argparse.Namespace, rps: float, text: str) -> dict[str, Any]:
    """One simulation, reduced to its table row (a process of its own under --jobs)."""
    hw, model, cfg = load_hardware(args.hardware), load_model(args.model), cli.build_config(args)
    spec = cli.workload_spec(args, rps)
    trace = build_trace(spec, None)
    end = max(t.arrival_s for t in trace)
    v = PolicyVariant.parse(text)
    m = (res := simulate(hw, model, v, cfg, trace, spec.trace_duration_s)).metrics
    return {"policy": v.label, "rps": rps, "ttft_attainment": m.ttft_attainment,
            "tbt_attainment": m.tbt_attainment, "tpot_attainment": m.tpot_attainment,
            "goodput_rps": m.goodput_rps, "rotations": m.rotations,
            **breakdown(res.records, end)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    hw, model = load_hardware(args.hardware), load_model(args.model)
    runs = [(rps, text) for rps in args.rps for text in args.policies.split(",")]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:  # rows in the order of `runs`
        rows = list(pool.map(run_one, [args] * len(runs), *zip(*runs, strict=True)))
    w = max(len(r["policy"]) for r in rows) if rows else 6
    head = (f"{'rps':>4} {'policy':<{w}} {'TTFT%':>6} {'miss':>5} {'long':>5} {'drain':>5} "
            f"{'p~miss':>6} {'p~hit':>6} {'TBT%':>6} {'mGaps':>6} {'stall_s':>8} {'maxgap':>7} "
            f"{'TPOT%':>6} {'goodput':>7}")
    print(f"{hw.name} + {model.name}, {args.dataset}, {args.duration:.0f} s of arrivals; SLOs "
          f"{args.ttft_slo} s / {args.tbt_slo * 1000:.0f} ms. miss = TTFT misses, long = of them "
          f"with prompts >= {LONG_PROMPT} tokens, drain = of them first served after arrivals "
          "ended; p~ = median prompt; mGaps = gaps over the TBT SLO, stall_s = their total length")
    print(head)
    for r in rows:
        print(f"{r['rps']:>4g} {r['policy']:<{w}} {100 * r['ttft_attainment']:>6.1f} "
              f"{r['ttft_misses']:>5} {r['ttft_misses_long_prompt']:>5} "
              f"{r['ttft_misses_after_arrivals_end']:>5} {r['median_prompt_miss'] or 0:>6.0f} "
              f"{r['median_prompt_hit'] or 0:>6.0f} {100 * r['tbt_attainment']:>6.1f} "
              f"{r['missed_gaps']:>6} {r['stall_s']:>8.0f} {r['max_gap_s']:>7.1f} "
              f"{100 * r['tpot_attainment']:>6.1f} {r['goodput_rps']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"hardware": hw.name, "model": model.name,
                                  "argv": sys.argv[2:]},
                       "results": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0

