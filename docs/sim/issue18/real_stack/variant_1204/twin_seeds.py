"""Issue #18's real-stack claim in the simulator's CPU twin, over many seeds.

    .venv/bin/python docs/sim/issue18/real_stack/variant_1204/twin_seeds.py \\
        RESULTS.json SEEDS RATES VARIANTS [OUT.json]

TWIN_HW (environment): another hardware profile than cpu-local (a name or a .json).
TWIN_LENGTHS (environment): "unknown" to send the requests as OpenAI clients without
max_tokens do (SimConfig.lengths); default "known", as `bench serve` sends them.
RESULTS.json: a stored `bench experiment` output whose config (pools, SLOs, lengths, serve
flags) every run takes; SEEDS e.g. 0-19; RATES e.g. 4.32,5.76; VARIANTS e.g.
lvf,lvf:parked_first=on:label=lvf-pf,swapped-first,waiting-first,fcfs. For each seed and
rate, one simulated pass per variant on the exact trace `bench serve` would send, then the
claim (`bench experiment`'s check: on the (TTFT, per-gap TBT) front against the baselines,
vLLM goodput >= theirs) for every lvf variant in lvf's place. Prints a row per seed and
rate and the count of seeds where each lvf variant holds the claim.
"""

from __future__ import annotations

import json
import os
import sys

from superinfer.bench.experiment import pareto_claim
from superinfer.sim import fidelity
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.sim.report import result_row


def seeds_of(text: str) -> list[int]:
    lo, sep, hi = text.partition("-")
    return list(range(int(lo), int(hi) + 1)) if sep else [int(s) for s in text.split(",")]


def main(path: str, seeds: str, rates: str, variants: str, out: str | None = None) -> None:
    hw, model = load_hardware(os.environ.get("TWIN_HW", "cpu-local")), load_model("smollm2-135m")
    base = fidelity.load_experiment(path)["config"]
    sat = float(base.get("saturation") or 2.88)
    vs = [PolicyVariant.parse(v) for v in variants.split(",")]
    lvfs = [v for v in vs if v.policy == "lvf"]
    rows, held = [], {(v.label, r): 0 for v in lvfs for r in rates.split(",")}
    for seed in seeds_of(seeds):
        config = {**base, "seed": seed}
        for rate in (float(r) for r in rates.split(",")):
            spec, trace = fidelity.trace_for(config, rate)
            at = {}
            for v in vs:
                ec, transfer = fidelity.engine_config(config, v.policy)
                cfg = v.apply(SimConfig.from_engine(
                    ec, **transfer, lengths=os.environ.get("TWIN_LENGTHS", "known")))
                res = Simulator(hw, model, v.policy, cfg, label=v.label).run(
                    trace, spec.trace_duration_s)
                at[v.label] = {**result_row(rate, res), "policy": v.label}
            baselines = [r for label, r in at.items()
                         if label not in {x.label for x in lvfs}]
            cells = []
            for v in lvfs:
                c = pareto_claim([*baselines, {**at[v.label], "policy": "lvf"}], sat)
                ok = bool(c["holds"])
                held[(v.label, f"{rate:g}")] += ok
                cells.append(f"{v.label} {'holds' if ok else 'FAILS'}"
                             f"{'' if ok else ' ' + ','.join(c['rates'][0]['dominated_by'])}")
            line = "  ".join(
                f"{label} {100 * r['ttft_attainment']:.0f}/{100 * r['tbt_attainment']:.2f}/"
                f"{100 * r['tpot_attainment']:.0f} {r['goodput_rps']:.2f}"
                for label, r in at.items())
            print(f"seed {seed:>2} rate {rate:g}: {line} | {'; '.join(cells)}", flush=True)
            rows.append({"seed": seed, "rate": rate, "runs": at})
    n = len(seeds_of(seeds))
    for (label, rate), k in held.items():
        print(f"{label} at {rate} req/s holds the claim on {k} of {n} seeds")
    if out:
        with open(out, "w") as f:
            json.dump({"results": path, "variants": variants, "saturation": sat,
                       "held": {f"{label}@{rate}": k for (label, rate), k in held.items()},
                       "seeds": n, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:6])
