"""Machine instructions per `schedule()` on `bench sched`'s loads, counted by valgrind's
callgrind: like decision_opcodes.py a measure the machine's load does not move, but one that
also counts what a bytecode instruction costs in C (a call, an attribute lookup through a
property, a float allocated per arithmetic step), so it follows CPU time more closely.
Run from each checkout's root with its own code first on the path and compare:

    (cd /work/main && PYTHONPATH=. .venv/bin/python $OLDPWD/docs/sim/issue18/decision_instructions.py)
    PYTHONPATH=. /work/main/.venv/bin/python docs/sim/issue18/decision_instructions.py

Each of `bench sched`'s 30 timed schedule() calls runs inside functools.reduce, so that
`--toggle-collect=functools_reduce` counts only them, and `--dump-after=math_gcd` (called
once after each) writes one profile part per call. Needs valgrind; about a minute per row
(the process runs some 50 times slower under it)."""

from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import statistics
import subprocess
import sys
import tempfile


def traced_bench(live: int, seats: int) -> None:
    """bench sched's measure() with each timed schedule() inside functools.reduce (run under
    callgrind by main())."""
    import superinfer.bench.sched as bench
    from scheduler_svc.scheduler import Scheduler

    schedule, calls = Scheduler.schedule, [0]

    def traced(self: Scheduler) -> object:
        calls[0] += 1
        if calls[0] <= 32 + 30:  # measure()'s min_residency + 30 steps to a steady state
            return schedule(self)
        out = functools.reduce(lambda s, _: schedule(s), (None,), self)
        math.gcd(1, 1)  # --dump-after=math_gcd: this call's part ends here
        return out

    Scheduler.schedule = traced  # type: ignore[method-assign]
    bench.measure(live, "lvf", 30, max_num_seqs=seats)


def count(live: int, seats: int) -> list[int]:
    """Instructions of each of the 30 timed calls, under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
             "--dump-after=math_gcd", f"--callgrind-out-file={tmp}/cg", sys.executable,
             __file__, "--traced", f"{live}:{seats}"],
            check=True, capture_output=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        per_call = []
        for part in glob.glob(f"{tmp}/cg.*"):
            with open(part) as f:
                for line in f:
                    if line.startswith(("summary:", "totals:")):
                        per_call.append(int(line.split()[1]))
                        break
    return sorted(per_call)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1000:256,10000:256,1000:4096,10000:4096")
    ap.add_argument("--traced", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.traced:
        traced_bench(*map(int, args.traced.split(":")))
        sys.exit(0)
    for row in args.rows.split(","):
        live, seats = map(int, row.split(":"))
        per_call = count(live, seats)
        print(f"{live:>6} live {seats:>5} seats: machine instructions per schedule() median "
              f"{statistics.median(per_call) / 1e6:.2f} M, mean "
              f"{statistics.fmean(per_call) / 1e6:.2f} M ({len(per_call)} calls)", flush=True)
