"""Cost of one scheduling decision (`schedule()`) with many live requests, no model.

Builds a loaded scheduler — requests running, waiting and rotary under memory pressure —
by driving the real scheduler with a trivial executor on a simulated clock, then times
`schedule()` calls at steady state. Each call is timed twice: wall clock, and CPU time of
this thread (what the decision itself costs, even on a machine busy with other work).

The running batch is capped by `--max-num-seqs` (the engine's default is 256, as vLLM's);
every running request costs a few microseconds per decision (its chunk and block table),
so the second default row shows the cost with a batch of thousands.

As in the service, a policy with an iteration time target (lvf) gets the online fit of the
executor's batch times (`OnlineIterationCost`), and every other VLT parameter and rotation
limit at the engine's default (`EngineConfig`); the trivial executor reports a modelled
time per batch (`5 ms + 0.1 ms per token`, about a GH200 decode step of Qwen2.5-32B), so
the time-budget path is part of what is measured.

`--prefix-caching off,on` measures both ways: prompts are distinct random tokens, so the
cache finds nothing and the row shows what naming blocks and looking prefixes up cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from common.config import EngineConfig
from common.contracts import ExecuteResult
from scheduler_svc.policy import VLTParams, make_policy
from scheduler_svc.policy.iteration_cost import OnlineIterationCost
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.setup import rotation_limits
from superinfer.bench.report import table, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--live", default="1000,10000", help="live request counts to measure")
    p.add_argument("--max-num-seqs", default="256,4096",
                   help="running-batch caps to measure (each with every --live count)")
    p.add_argument("--policy", default="lvf")
    p.add_argument("--iterations", type=int, default=30, help="timed schedule() calls")
    p.add_argument("--xfer-budget-blocks", type=int, default=2400, help="B_xfer (GH200 default)")
    p.add_argument("--min-residency", type=int, default=32)
    p.add_argument("--max-stall", type=float, default=None,
                   help="LVF's stall bound, a share of the TTFT SLO (default: off)")
    p.add_argument("--prefix-caching", default="off",
                   help="off, on, or both (off,on): automatic prefix caching in the scheduler")
    p.add_argument("--json", default=None, help="write results to this JSON file")


def measure(live: int, policy: str, iterations: int, xfer_budget: int | None = 2400,
            min_residency: int = 32, seed: int = 0,
            max_num_seqs: int = 256, prefix_caching: bool = False,
            max_stall: float | None = None) -> dict[str, float]:
    rng = random.Random(seed)
    tokens = random.Random(seed + 1)  # distinct prompts: nothing for a prefix cache to find
    clock = [0.0]
    bs = 16
    # Device memory for about a third of the live requests' KV: rotation is in play.
    # The policy as `superinfer serve` builds it: every VLT parameter and rotation limit at
    # the engine's default but the ones measured here.
    served = rotation_limits(EngineConfig(policy=policy, xfer_budget_blocks=xfer_budget))
    pol = make_policy(policy, VLTParams(max_stall=max_stall),
                      dataclasses.replace(served, min_residency=min_residency))
    cost = OnlineIterationCost() if pol.iteration_target_s(0.1) is not None else None
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=live * 2, num_host_blocks=live * 8, block_size=bs,
                        max_batched_tokens=8192, max_num_seqs=max_num_seqs,
                        eager_budget_blocks=256, enable_prefix_caching=prefix_caching),
        pol, clock=lambda: clock[0], cost=cost,
    )
    for i in range(live):
        sched.add_request(Request(
            f"r{i}", [tokens.randrange(49152) for _ in range(rng.randint(16, 160))],
            SamplingParams(max_tokens=10_000, ignore_eos=True),
            arrival_time=clock[0] - rng.random() * 5, slo=SLO(5.0, 0.1),
        ))

    def step() -> tuple[float, float]:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = sched.schedule()
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if out.transfers is not None:
            sched.complete_transfer(out.transfers.fence)
        execute_s = 0.005 + 1e-4 * out.num_tokens
        sched.update_from_output(out, ExecuteResult({c.request_id: 1 for c in out.chunks
                                                     if c.sample}, execute_s=execute_s))
        clock[0] += execute_s
        return dt, dc

    # Reach a steady state: past min_residency, so that rotation is in play.
    for _ in range(min_residency + 30):
        step()
    samples = [step() for _ in range(iterations)]
    times, cpu = [s[0] for s in samples], [s[1] for s in samples]
    return {
        "live": live,
        "max_num_seqs": max_num_seqs,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "rotary": len(sched.rotary),
        "mean_ms": statistics.fmean(times) * 1e3,
        "p50_ms": statistics.median(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "cpu_p50_ms": statistics.median(cpu) * 1e3,
        "cpu_max_ms": max(cpu) * 1e3,
        "rotations": sched.stats.rotations,
        "time_budget": cost is not None,
        "prefix_caching": prefix_caching,
    }


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() == "on" for m in args.prefix_caching.split(",")]
    rows = [measure(int(n), args.policy, args.iterations, args.xfer_budget_blocks,
                    args.min_residency, max_num_seqs=int(m), prefix_caching=pc,
                    max_stall=args.max_stall)
            for m in args.max_num_seqs.split(",") for n in args.live.split(",") for pc in modes]
    keys = ["live", "max_num_seqs", "prefix_caching", "running", "waiting", "rotary", "mean_ms",
            "p50_ms", "max_ms", "cpu_p50_ms", "cpu_max_ms", "rotations", "time_budget"]
    stall = "" if args.max_stall is None else f", max stall {args.max_stall}"
    print(f"schedule() cost, policy {args.policy}{stall}")
    print(table(keys, [[r[k] for k in keys] for r in rows]))
    write_json(args.json, {"policy": args.policy, "max_stall": args.max_stall, "results": rows})
    return 0
