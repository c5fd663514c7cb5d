"""The time between tokens the LVF policy sees (its moving mean of batch times, gap_s),
over one simulator run: `python docs/sim/issue18/regime_gate_1206/gap_probe.py sim ARGS`
prints the batch times' and the moving mean's 10th/50th/90th percentiles to stderr."""
import atexit
import runpy
import sys

from scheduler_svc.policy import lvf

samples: list[tuple[float, float]] = []
_observe = lvf.LVFPolicy.observe_iteration


def _probe(self: lvf.LVFPolicy, seconds: float) -> bool:
    out = _observe(self, seconds)
    samples.append((seconds, self._gap_mean or 0.0))
    return out


def _dump() -> None:
    if not samples:
        return
    def q(a: list[float], p: float) -> float:
        return sorted(a)[int(p * (len(a) - 1))] * 1000
    batch, mean = [s[0] for s in samples], [s[1] for s in samples]
    print("batch ms p10/50/90", [round(q(batch, p), 1) for p in (0.1, 0.5, 0.9)],
          "moving mean ms p10/50/90", [round(q(mean, p), 1) for p in (0.1, 0.5, 0.9)],
          file=sys.stderr)


lvf.LVFPolicy.observe_iteration = _probe  # type: ignore[method-assign]
atexit.register(_dump)
sys.argv = ["superinfer.sim.cli", *sys.argv[1:]]
runpy.run_module("superinfer.sim.cli", run_name="__main__")
