"""`superinfer bench …`: what a user benchmarks. Each prints a table and can write JSON.

A subcommand's module is imported only when that subcommand runs, so `superinfer serve`
and the light services never load a benchmark's dependencies. The studies behind
docs/results/ live in the checkout's `experiments/` folder (`python -m experiments`).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# subcommand -> (module, help). Each module has `add_arguments(p)` and `run(args) -> int`.
BENCHES = {
    "serve": ("superinfer.bench.serve",
              "load an OpenAI-compatible server: TTFT/TBT/TPOT, SLO attainment, goodput"),
    "engine": ("superinfer.bench.engine",
               "the engine in one process: decode tok/s and TTFT at batch 1/8/32"),
    "transfer": ("superinfer.bench.transfer",
                 "KV block transfers: GB/s per DuplexKV mode vs a raw copy"),
    "gpu-worker": ("superinfer.bench.gpu_worker",
                   "the CUDA worker: greedy vs CPU fp32, 8B-shaped decode vs roofline"),
}


def _run_lazily(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)


def add_parser(sub: argparse._SubParsersAction, argv: list[str] | None = None) -> None:
    """Add `bench`; the chosen subcommand's flags are added only when `argv` names it
    (help for the others lists them by name and purpose)."""
    p = sub.add_parser("bench", help="benchmarks", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = p.add_subparsers(dest="bench", required=True)
    chosen = argv[1] if argv and len(argv) > 1 and argv[0] == "bench" else None
    for name, (module, help_text) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_text, description=help_text)
        if name != chosen:
            continue
        mod: Any = importlib.import_module(module)
        mod.add_arguments(bp)
        bp.set_defaults(func=_run_lazily, bench_run=mod.run)
