"""Replay a real-stack LVF pass in the simulator with its execute time matched to the real
run's (`superinfer sim fidelity`'s timing-matched run), list the requests that missed
TPOT, and, given a request id, follow it while it is parked: each iteration, its slack,
its place in LVF's order, the head of that order, the running count and the free blocks.

    .venv/bin/python docs/sim/issue18/real_stack/split_1204/replay.py RESULTS_JSON [VARIANT] [REQUEST_ID]
"""

from __future__ import annotations

import sys
from typing import Any

from scheduler_svc.request import RequestState
from scheduler_svc.scheduler import Scheduler
from superinfer.bench.server_stats import scheduler_stat
from superinfer.sim import fidelity
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.sim.report import result_row


def main(argv: list[str]) -> None:
    data = fidelity.load_experiment(argv[0])
    variant = PolicyVariant.parse(argv[1] if len(argv) > 1 else "lvf")
    target = argv[2] if len(argv) > 2 else None
    hw, model = load_hardware("cpu-local"), load_model("smollm2-135m")
    config, real = data["config"], data["results"][0]
    ec, transfer = fidelity.engine_config(config, variant.policy)
    cfg = variant.apply(SimConfig.from_engine(ec, **transfer))
    spec, trace = fidelity.trace_for(config, float(real["rps"]))
    # The real run's time per batch, from the server's counters (as `sim fidelity` takes it).
    delta = (real.get("stats") or {}).get("server_metrics_delta") or {}
    real_batch = fidelity.real_batch_s(*(scheduler_stat(delta, key) for key in
                                         ("execute_s", "execute_rpc_s", "executes")),
                                       ec.pipeline)
    if real_batch is None:
        raise SystemExit(f"{argv[0]}: the pass has no server execute counters to match")
    k, res = fidelity.match_execute(hw, model, variant.policy, cfg, trace,
                                    spec.trace_duration_s, real_batch)
    log: list[tuple[Any, ...]] = []
    if target is not None:  # the matched run once more, followed (it is deterministic)
        schedule = Scheduler.schedule

        def traced(self: Scheduler) -> Any:
            q = self.requests.get(target)
            if q is not None and q.state is RequestState.ROTARY:
                now, pol = self.clock(), self.policy
                order = sorted([*self.waiting.list(), *self.rotary.list()],
                               key=lambda r: pol.merge_key(r, now))
                head = order[0]
                slack = pol.slack_s(q, now)
                log.append((round(now, 2), None if slack is None else round(slack, 2),
                            order.index(q), len(order), head.request_id, head.state.name,
                            len(self.running), self.bm.num_free_for_compute))
            return schedule(self)

        Scheduler.schedule = traced  # type: ignore[method-assign]
        res = Simulator(fidelity.scaled_hardware(hw, k), model, variant.policy, cfg).run(
            trace, spec.trace_duration_s)
        Scheduler.schedule = schedule  # type: ignore[method-assign]
    row = result_row(float(real["rps"]), res)
    print(f"{variant.label}: execute scale {k:.3f}; TTFT / per-gap TBT / TPOT % "
          f"{100 * row['ttft_attainment']:.1f} / {100 * row['tbt_attainment']:.1f} / "
          f"{100 * row['tpot_attainment']:.1f}, goodput {row['goodput_rps']:.3f}, longest gap "
          f"{row['max_gap_s']:.1f} s; preemptions {res.stats['preemptions']} (growth "
          f"{res.stats['growth_preemptions']}, for parked {res.stats['parked_preemptions']})")
    missed = [r for r in res.records if (r.tpot_s() or 0.0) > r.tbt_slo_s]
    print(f"missed TPOT: {len(missed)}")
    for r in missed:
        print(f"  {r.request_id}: TPOT {r.tpot_s():.3f} s, rotations {r.rotations}, "
              f"longest gap {max(r.gaps()):.1f} s")
    if log:
        print(f"{target} while parked: time s, slack s (None: late), place in LVF's order, "
              "candidates, head, head's state, running, free blocks")
        for e in log[::max(1, len(log) // 60)] + log[-1:]:
            print("  " + ", ".join(str(x) for x in e))


if __name__ == "__main__":
    main(sys.argv[1:])
