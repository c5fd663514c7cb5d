"""Python bytecode instructions per `schedule()` on `bench sched`'s loads: a measure of the
decision cost that the machine's load does not move (CPU time on 2 busy cores drifts by
half between runs). Run from each checkout's root with its own venv and compare:

    (cd /work/main && OMP_NUM_THREADS=1 .venv/bin/python $OLDPWD/docs/sim/issue18/decision_opcodes.py)
    OMP_NUM_THREADS=1 .venv/bin/python docs/sim/issue18/decision_opcodes.py

Counts the interpreter's opcode trace events (sys.settrace, f_trace_opcodes) inside each
of the 30 timed schedule() calls of `bench sched`'s measure(); C code (list slicing, dict
lookups, bisect) counts as the one instruction that calls it. `--top N` lists the functions
that execute the most instructions (totals over the 30 calls / 30)."""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from types import FrameType
from typing import Any

import superinfer.bench.sched as bench
from scheduler_svc.scheduler import Scheduler


def count(live: int, seats: int) -> tuple[list[int], collections.Counter[str]]:
    per_call: list[int] = []
    by_function: collections.Counter[str] = collections.Counter()
    current = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:  # noqa: ANN401
        frame.f_trace_opcodes = True
        if event == "opcode":
            current[0] += 1
            by_function[frame.f_code.co_qualname] += 1
        return tracer

    schedule, calls = Scheduler.schedule, [0]

    def traced(self: Scheduler) -> Any:  # noqa: ANN401
        calls[0] += 1
        if calls[0] <= 32 + 30:  # measure()'s min_residency + 30 steps to a steady state
            return schedule(self)
        current[0] = 0
        sys.settrace(tracer)
        try:
            return schedule(self)
        finally:
            sys.settrace(None)
            per_call.append(current[0])

    Scheduler.schedule = traced  # type: ignore[method-assign]
    try:
        bench.measure(live, "lvf", 30, max_num_seqs=seats)
    finally:
        Scheduler.schedule = schedule  # type: ignore[method-assign]
    return per_call, by_function


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000:256,10000:256,1000:4096,10000:4096")
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args()
    for row in args.rows.split(","):
        live, seats = map(int, row.split(":"))
        per_call, by_function = count(live, seats)
        print(f"{live:>6} live {seats:>5} seats: instructions per schedule() median "
              f"{statistics.median(per_call):,.0f}, mean {statistics.fmean(per_call):,.0f}",
              flush=True)
        for name, n in by_function.most_common(args.top):
            print(f"    {n / len(per_call):>9,.0f}  {name}")
