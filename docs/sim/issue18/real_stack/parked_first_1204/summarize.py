"""One row per policy pass of `bench experiment` results: attainment, goodput, rotations
(growth preemptions and those that seated a parked request among them, where the server
counted them), stalls.

    .venv/bin/python docs/sim/issue18/real_stack/parked_first_1204/summarize.py DIR ... [--json OUT]

Each DIR holds a results.json. Stalls: the longest gap between two tokens of a request,
and the seconds of gaps over the TBT SLO, from the per-request token times.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(d: Path) -> list[dict]:
    data = json.loads((d / "results.json").read_text())
    slo = data["config"]["tbt_slo"]
    out = []
    for r in data["results"]:
        gaps = [b - a for q in r["per_request"]
                for a, b in zip(q["token_times_s"], q["token_times_s"][1:])]
        delta = r.get("stats", {}).get("server_metrics_delta", {})
        growth = delta.get("superinfer_scheduler_growth_preemptions_total")
        parked = delta.get("superinfer_scheduler_parked_preemptions_total")
        out.append({
            "pass": d.name, "policy": r["policy"], "rps": r["rps"],
            "ttft": round(100 * r["ttft_attainment"], 1),
            "tbt": round(100 * r["tbt_attainment"], 1),
            "tpot": round(100 * r["tpot_attainment"], 1),
            "goodput": round(r["goodput_rps"], 3),
            "p50_ttft_s": round(r["p50_ttft_s"], 2), "p99_ttft_s": round(r["p99_ttft_s"], 2),
            "tok_s": round(r["throughput_tok_s"], 1), "rotations": r["rotations"],
            "growth_preemptions": None if growth is None else int(growth),
            "parked_preemptions": None if parked is None else int(parked),
            "longest_gap_s": round(max(gaps, default=0.0), 2),
            "gap_s_over_slo": round(sum(g for g in gaps if g > slo), 1),
        })
    return out


def main(argv: list[str]) -> None:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    table = [r for d in argv for r in rows(Path(d))]
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    if out:
        Path(out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
