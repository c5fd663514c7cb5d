"""What holds the seats when LVF preempts, over one simulator run (run with --jobs 1):
`python docs/sim/issue18/memory_margin_1206/seat_probe.py sim ARGS` prints to stderr how
many of the victims `may_preempt` allowed were for a candidate whose seat the
iteration-time budget held (`Policy.time_bound`), how many were not, and the batch's
running count against the seat limit and max_num_seqs at those moments (medians)."""
import atexit
import runpy
import statistics
import sys

from scheduler_svc import scheduler
from scheduler_svc.policy import lvf

allowed = {True: 0, False: 0}
seats: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
_may = lvf.LVFPolicy.may_preempt
_admit = scheduler.Scheduler._admit
current: list[scheduler.Scheduler] = []


def _probe_may(self: lvf.LVFPolicy, victim, candidate, now: float) -> bool:
    out = _may(self, victim, candidate, now)
    if out:
        allowed[self.time_bound] += 1
        s = current[-1]
        seats[self.time_bound].append((len(s.running), s._seat_limit))
    return out


def _probe_admit(self, *args, **kwargs):
    current.append(self)
    try:
        return _admit(self, *args, **kwargs)
    finally:
        current.pop()


def _dump() -> None:
    for bound, name in ((True, "budget holds the seat"), (False, "memory / max_num_seqs")):
        rs = seats[bound]
        med = (f"running p50 {statistics.median(r for r, _ in rs):.0f}, seat limit p50 "
               f"{statistics.median(s for _, s in rs):.0f}") if rs else "-"
        print(f"victims allowed, {name}: {allowed[bound]} ({med})", file=sys.stderr)


lvf.LVFPolicy.may_preempt = _probe_may  # type: ignore[method-assign]
scheduler.Scheduler._admit = _probe_admit  # type: ignore[method-assign]
atexit.register(_dump)
sys.argv = ["superinfer.sim.cli", *sys.argv[1:]]
runpy.run_module("superinfer.sim.cli", run_name="__main__")
