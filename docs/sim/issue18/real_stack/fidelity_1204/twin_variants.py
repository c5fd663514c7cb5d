"""Replay stored `bench experiment` passes in the simulator's CPU twin with policy variants.

    .venv/bin/python docs/sim/issue18/real_stack/fidelity_1204/twin_variants.py \\
        cpu-local RESULTS.json[,RESULTS.json...] lvf,lvf:parked_first=on,swapped-first

Each pass's exact trace and serve flags (as `sim fidelity` rebuilds them), its real rows,
then one simulated row per variant: TTFT / per-gap TBT / TPOT %, goodput, rotations.
"""

from __future__ import annotations

import sys

from superinfer.sim import fidelity
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.sim.report import result_row


def main(hardware: str, paths: str, variants: str) -> None:
    hw, model = load_hardware(hardware), load_model("smollm2-135m")
    for path in paths.split(","):
        data = fidelity.load_experiment(path)
        config = data["config"]
        rps = float(data["results"][0]["rps"])
        print(path, rps)
        for r in data["results"]:
            print(f"   real {r['policy']:<22} {100 * r['ttft_attainment']:5.1f} / "
                  f"{100 * r['tbt_attainment']:5.2f} / {100 * r['tpot_attainment']:5.1f}  "
                  f"{r['goodput_rps']:.3f}")
        spec, trace = fidelity.trace_for(config, rps)  # one trace, every variant replays it
        for v in variants.split(","):
            pv = PolicyVariant.parse(v)
            ec, transfer = fidelity.engine_config(config, pv.policy)
            cfg = pv.apply(SimConfig.from_engine(ec, **transfer))
            res = Simulator(hw, model, pv.policy, cfg, label=v).run(trace, spec.trace_duration_s)
            row = result_row(rps, res)
            print(f"   sim  {v:<22} {100 * row['ttft_attainment']:5.1f} / "
                  f"{100 * row['tbt_attainment']:5.2f} / {100 * row['tpot_attainment']:5.1f}  "
                  f"{row['goodput_rps']:.3f}  rot {row.get('rotations')}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
