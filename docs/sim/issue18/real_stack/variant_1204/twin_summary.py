"""Means over the seeds of a twin_seeds.py JSON: per rate and policy, TTFT / per-gap TBT /
TPOT %, vLLM goodput, makespan, longest gap, rotations; and why each lvf variant failed
the claim (dominated on (TTFT, TBT), or goodput alone).

    .venv/bin/python docs/sim/issue18/real_stack/variant_1204/twin_summary.py TWIN.json
"""

from __future__ import annotations

import json
import statistics
import sys

from superinfer.bench.experiment import pareto_claim


def main(path: str) -> None:
    d = json.loads(open(path).read())
    rates = sorted({r["rate"] for r in d["rows"]})
    labels = list(d["rows"][0]["runs"])
    lvfs = [lb for lb in labels if d["rows"][0]["runs"][lb]["base_policy"] == "lvf"]
    for rate in rates:
        rows = [r for r in d["rows"] if r["rate"] == rate]
        print(f"rate {rate:g} req/s, {len(rows)} seeds (means; goodput at equal attainment "
              "is the makespan's inverse)")
        print(f"  {'policy':<14} {'TTFT':>6} {'TBT':>6} {'TPOT':>6} {'goodput':>8} "
              f"{'makespan':>9} {'max gap':>8} {'gap>5s':>7} {'rot':>5}")
        for lb in labels:
            runs = [r["runs"][lb] for r in rows]

            def m(key: str, scale: float = 1.0, runs: list = runs) -> float:
                return statistics.fmean(scale * (x[key] or 0.0) for x in runs)

            span = statistics.fmean(x["good_requests"] / x["goodput_rps"] for x in runs
                                    if x["goodput_rps"])
            stalls = statistics.fmean((x["max_gap_s"] or 0) > 5 for x in runs)
            print(f"  {lb:<14} {m('ttft_attainment', 100):6.2f} {m('tbt_attainment', 100):6.2f} "
                  f"{m('tpot_attainment', 100):6.2f} {m('goodput_rps'):8.3f} {span:9.2f} "
                  f"{m('max_gap_s'):8.2f} {100 * stalls:6.0f}% {m('rotations'):5.1f}")
        for lb in lvfs:
            dominated = goodput_only = held = 0
            for r in rows:
                base = [x for k, x in r["runs"].items() if k not in lvfs]
                c = pareto_claim([*base, {**r["runs"][lb], "policy": "lvf"}], 1.0)["rates"][0]
                held += c["holds"]
                dominated += bool(c["dominated_by"])
                goodput_only += not c["holds"] and not c["dominated_by"]
            print(f"  {lb}: holds on {held}, dominated on {dominated}, goodput alone short "
                  f"on {goodput_only} of {len(rows)} seeds")


if __name__ == "__main__":
    main(sys.argv[1])
