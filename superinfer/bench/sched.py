"""Cost of one scheduling decision (`schedule()`) with many live requests, no model.

Builds a loaded scheduler — requests running, waiting and rotary under memory pressure —
by driving the real scheduler with a trivial executor on a simulated clock, then times
`schedule()` calls at steady state.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from scheduler_svc.interfaces import ExecuteResult
from scheduler_svc.policy import RotationLimits, VLTParams, make_policy
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from superinfer.bench.report import table, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--live", default="1000,10000", help="live request counts to measure")
    p.add_argument("--policy", default="lvf")
    p.add_argument("--iterations", type=int, default=30, help="timed schedule() calls")
    p.add_argument("--xfer-budget-blocks", type=int, default=2400, help="B_xfer (GH200 default)")
    p.add_argument("--min-residency", type=int, default=32)
    p.add_argument("--json", default=None, help="write results to this JSON file")


def measure(live: int, policy: str, iterations: int, xfer_budget: int | None = 2400,
            min_residency: int = 32, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    clock = [0.0]
    bs = 16
    # Device memory for about a third of the live requests' KV: rotation is in play.
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=live * 2, num_host_blocks=live * 8, block_size=bs,
                        max_batched_tokens=8192, max_num_seqs=max(256, live // 2),
                        eager_budget_blocks=256),
        make_policy(policy, VLTParams(), RotationLimits(xfer_budget, min_residency)),
        clock=lambda: clock[0],
    )
    for i in range(live):
        sched.add_request(Request(
            f"r{i}", [1] * rng.randint(16, 160), SamplingParams(max_tokens=10_000, ignore_eos=True),
            arrival_time=clock[0] - rng.random() * 5, slo=SLO(5.0, 0.1),
        ))

    def step() -> float:
        t0 = time.perf_counter()
        out = sched.schedule()
        dt = time.perf_counter() - t0
        if out.transfers is not None:
            sched.complete_transfer(out.transfers.fence)
        sched.update_from_output(out, ExecuteResult({c.request_id: 1 for c in out.chunks
                                                     if c.sample}))
        clock[0] += 0.05
        return dt

    for _ in range(10):  # reach a steady state
        step()
    times = [step() for _ in range(iterations)]
    return {
        "live": live,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "rotary": len(sched.rotary),
        "mean_ms": statistics.fmean(times) * 1e3,
        "p50_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "rotations": sched.stats.rotations,
    }


def run(args: argparse.Namespace) -> int:
    rows = [measure(int(n), args.policy, args.iterations, args.xfer_budget_blocks,
                    args.min_residency) for n in args.live.split(",")]
    keys = ["live", "running", "waiting", "rotary", "mean_ms", "p50_ms", "max_ms", "rotations"]
    print(f"schedule() cost, policy {args.policy}")
    print(table(keys, [[r[k] for k in keys] for r in rows]))
    write_json(args.json, {"policy": args.policy, "results": rows})
    return 0
