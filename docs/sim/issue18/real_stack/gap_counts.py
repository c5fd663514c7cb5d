"""Per-gap misses and long stalls per pass, from `bench experiment` results.

    .venv/bin/python docs/sim/issue18/real_stack/gap_counts.py DIR [DIR ...]

Each DIR holds a results.json. Prints, per policy: TTFT / per-gap TBT / TPOT %, goodput,
gaps over the TBT SLO of all gaps, gaps over 5 s, and the longest gap (the stalls that
the per-gap attainment counts once each; README.md, 2026-12-03 night).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STALL_S = 5.0


def main(dirs: list[str]) -> None:
    for d in dirs:
        data = json.loads((Path(d) / "results.json").read_text())
        tbt_slo = data["config"]["tbt_slo"]
        print(d)
        for row in data["results"]:
            gaps = [b - a for r in row["per_request"]
                    for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
            print(f"  {row['policy']:<14} {100 * row['ttft_attainment']:5.1f} / "
                  f"{100 * row['tbt_attainment']:5.2f} / {100 * row['tpot_attainment']:5.1f}"
                  f"  goodput {row['goodput_rps']:.3f}  misses {sum(g > tbt_slo for g in gaps)}"
                  f"/{len(gaps)}  > {STALL_S:.0f} s {sum(g > STALL_S for g in gaps)}"
                  f"  longest {max(gaps, default=0.0):.1f} s  rotations {row['rotations']}")


if __name__ == "__main__":
    main(sys.argv[1:])
