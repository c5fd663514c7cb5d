"""What-if for the scheduler lead (not product code): LVF with and without the head-of-line stop.

DESIGN 4, LVF step 3 once said "stop at the first q that cannot be served". In a
memory-bound run the head of LVF's queue is a rotary request whose whole KV (tens of
blocks) must come back, while every running request is still inside its minimum residency;
the walk stopped there, and the waiting requests behind it, whose first chunk needs a few
blocks, never got a turn. LVF now skips such a candidate (`LVFPolicy.on_unservable`,
unless it holds the line). This script runs the *real* scheduler with LVF's answer turned
back into the strict stop, and prints the same table as `superinfer sim`, so the two can be
compared (run `superinfer sim` itself for the product's LVF).

    python docs/sim/whatif_skip_unservable.py --hardware gh200-96gb --rps 8,11,14 \
        --duration 120 --policies lvf --json docs/sim/whatif_strict.json
"""

from __future__ import annotations

import sys

from scheduler_svc.policy import Unservable, lvf
from scheduler_svc.request import Request
from superinfer.sim import cli


def strict(self: lvf.LVFPolicy, candidate: Request, now: float) -> Unservable:
    return Unservable.STOP  # what-if: the strict head-of-line stop


def main() -> int:
    lvf.LVFPolicy.on_unservable = strict  # type: ignore[method-assign]
    return cli.main(["sim", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
