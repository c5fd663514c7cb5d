"""What-if for the scheduler lead (not product code): LVF without head-of-line blocking.

DESIGN 4, LVF step 3 says "stop at the first q that cannot be served", and
`Scheduler._admit` does exactly that. In a memory-bound run the head of LVF's queue is a
rotary request whose whole KV (tens of blocks) must come back, while every running request
is still inside its minimum residency; the walk stops there, and the waiting requests
behind it, whose first chunk needs a few blocks, never get a turn. This script runs the
*real* scheduler with that one `break` turned into `continue` (skip the candidate, try the
next) and prints the same table as `superinfer sim`, so the two can be compared.

    python docs/sim/whatif_skip_unservable.py --hardware gh200-96gb --rps 8,11,14 \
        --duration 120 --policies lvf --json docs/sim/whatif_skip.json

It patches a copy of `_admit` taken from the source at run time; if the line it patches
changes, it says so instead of running something else.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import scheduler_svc.scheduler as core
from superinfer.sim import cli, engine

LINE = "break  # stop at the first request that cannot be served"


def _patched_scheduler_class() -> type[core.Scheduler]:
    src = textwrap.dedent(inspect.getsource(core.Scheduler._admit))
    if LINE not in src:
        raise SystemExit(f"Scheduler._admit no longer contains {LINE!r}; update this what-if")
    ns: dict[str, object] = {}
    exec(compile(src.replace(LINE, "continue  # what-if: skip it"), "<what-if>", "exec"),
         vars(core), ns)
    return type("SkipUnservableScheduler", (core.Scheduler,), {"_admit": ns["_admit"]})


def main() -> int:
    cls = _patched_scheduler_class()
    make = engine.Simulator.make_scheduler

    def make_scheduler(self: engine.Simulator, clock: object) -> core.Scheduler:
        s = make(self, clock)  # type: ignore[arg-type]
        s.__class__ = cls
        return s

    engine.Simulator.make_scheduler = make_scheduler  # type: ignore[method-assign]
    return cli.main(["sim", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
