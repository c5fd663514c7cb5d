"""What-if for finding (b) (not product code): new requests that hold the line go first.

LVF's `holds_the_line` stops *smaller new* requests from being admitted past a new request
that has spent half its TTFT budget (`--hold-vlt`). Rotary requests still rank ahead of it
by VLT, and under sustained overload there is always one, so long prompts wait for the
drain (docs/sim/README.md §6.8). This script runs `superinfer sim` with one change to
`LVFPolicy.merge_key`: a request that holds the line ranks before every other candidate,
rotary ones included (largest VLT first within each tier; the tier is monotone in arrival
within a group, so the scheduler's lazy merge stays exact).

    python docs/sim/whatif_hold_first.py --hardware gh200-96gb --model qwen2.5-32b \
        --dataset sharegpt --duration 120 --rps 14,20 --policies lvf --json out.json
    python docs/sim/whatif_hold_first.py --starvation …   # the same, with starvation.py's table
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from scheduler_svc.policy import lvf
from scheduler_svc.policy.vlt import vlt
from scheduler_svc.request import Request


def merge_key(self: lvf.LVFPolicy, req: Request, now: float) -> tuple[float, ...]:
    tier = 0.0 if self.holds_the_line(req, now) else 1.0
    return (tier, -vlt(req, now, self.params), req.arrival_time)


def main() -> int:
    lvf.LVFPolicy.merge_key = merge_key  # type: ignore[method-assign]
    argv = sys.argv[1:]
    if argv[:1] == ["--starvation"]:
        sys.argv = [str(Path(__file__).with_name("starvation.py")), *argv[1:]]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    from superinfer.sim import cli

    return cli.main(["sim", *argv])


if __name__ == "__main__":
    sys.exit(main())
