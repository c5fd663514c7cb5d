"""`python -m experiments NAME …`: the studies behind docs/results/, run from a checkout.

Each module has `add_arguments(p)` and `run(args) -> int`, like `superinfer bench`'s.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one line of help)
STUDIES = {
    "policies": ("experiments.policies",
                 "rotation policies on the real stack: rate sweep, table, plot, claim check"),
    "must-show": ("experiments.must_show",
                  "the simulator's must-show cells: every policy, checked against LVF's bars"),
    "rate-step": ("experiments.rate_step",
                  "a 1x -> 2x -> 1x rate step in the simulator: LVF's rules per phase"),
    "rate-step-real": ("experiments.rate_step_real",
                       "the rate step on the real stack: adaptive residency against fixed ones"),
    "defaults-diff": ("experiments.defaults_diff",
                      "LVF's must-show cells now against the committed noise of the old defaults"),
    "starvation": ("experiments.starvation",
                   "who misses their SLOs in the simulator, and for how long"),
    "tenant-shares": ("experiments.tenant_shares",
                      "fair shares across tenants in the simulator: flood, on/off, rotation, blame"),
    "tenant-shares-real": ("experiments.tenant_shares_real",
                           "fair shares on the real stack: an interactive tenant under a flood"),
    "fidelity": ("experiments.fidelity", "the simulator against a `policies` run of the real stack"),
    "calibrate-serving": ("experiments.calibrate_serving",
                          "`sim calibrate`, scaled by the worker's slowdown inside the stack"),
    "transfer-modes": ("experiments.transfer_modes",
                       "time waiting on KV transfers per DuplexKV mode, real services"),
    "overhead": ("experiments.overhead", "decode throughput through the services vs in-process"),
    "pipeline": ("experiments.pipeline",
                 "the worker's compute share with the pipelined step and without"),
    "prefix-cache": ("experiments.prefix_cache",
                     "prefix caching on vs off on the real stack: multi-turn chat, host tier"),
    "grammar": ("experiments.grammar",
                "structured outputs: the grammar mask's cost per token vs free requests"),
    "sched": ("experiments.sched", "cost of one scheduling decision at 1,000 and 10,000 live"),
    "quality": ("experiments.quality",
                "perplexity and greedy agreement of each executor format vs float32"),
    "tp": ("experiments.tp", "tensor parallel: decode tok/s of 2 gloo ranks vs 1, synthetic model"),
    "replicas": ("experiments.replicas",
                 "two replicas behind vllm-router: round_robin, power_of_two, cache_aware, "
                 "kv_aware on one multi-turn load"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    sub = parser.add_subparsers(dest="study", required=True)
    for name, (_, help_text) in STUDIES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in STUDIES:
        build_parser().parse_args(argv)  # prints usage, exits
        return 2
    name = argv[0]
    module = importlib.import_module(STUDIES[name][0])
    p = argparse.ArgumentParser(prog=f"python -m experiments {name}",
                                description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    from common.logging import configure_logging

    configure_logging(name, level="warning")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
