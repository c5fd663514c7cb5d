"""`superinfer bench …`: benchmark commands. Each prints a table and can write JSON."""

from __future__ import annotations

import argparse
import importlib

# subcommand -> (module, help). Each module has `add_arguments(p)` and `run(args) -> int`.
BENCHES = {
    "engine": ("superinfer.bench.engine", "decode throughput and TTFT vs transformers"),
    "quality": ("superinfer.bench.quality",
                "perplexity and greedy agreement of each executor format vs float32"),
    "sched": ("superinfer.bench.sched", "cost of one scheduling decision"),
    "transfer": ("superinfer.bench.transfer", "KV block transfer GB/s per DuplexKV mode vs raw"),
    "transfer-modes": ("superinfer.bench.transfer_modes",
                       "time waiting on KV transfers per DuplexKV mode, real services"),
    "overhead": ("superinfer.bench.serve_overhead",
                 "decode throughput through the services vs in-process"),
    "pipeline": ("superinfer.bench.pipeline",
                 "the worker's compute share with the pipelined step and without"),
    "grammar": ("superinfer.bench.grammar",
                "structured outputs: the grammar mask's cost per token vs free requests"),
    "gpu-worker": ("superinfer.bench.gpu_worker",
                   "the CUDA worker: greedy vs CPU fp32, 8B-shaped decode vs roofline"),
    "serve": ("superinfer.bench.serve", "load benchmark of an OpenAI-compatible server"),
    "experiment": ("superinfer.bench.experiment",
                   "rotation policies on the real stack: rate sweep, table, plot, claim check"),
    "tp": ("superinfer.bench.tp",
           "tensor parallel: decode tok/s of 2 gloo ranks vs 1 rank, synthetic model"),
    "prefix-cache": ("superinfer.bench.prefix_cache",
                     "prefix caching on vs off on the real stack: multi-turn chat, host tier"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
