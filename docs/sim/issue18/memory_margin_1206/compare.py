"""Per-cell LVF rows of LVF-only runs (lazy_1202/lvf_only.sh's JSON) beside the stored
default LVF row and the best baseline's goodput.

    .venv/bin/python docs/sim/issue18/memory_margin_1206/compare.py DIR [DIR...]

TTFT / per-gap TBT / TPOT %, vLLM goodput (req/s) and rotations, one line per (cell, rate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ISSUE18 = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ISSUE18))
from must_show import BASELINES, MIXED, RUNS  # noqa: E402

NAMES = RUNS + MIXED


def row(r: dict) -> str:
    return (f"{100 * r['ttft_attainment']:5.1f} / {100 * r['tbt_attainment']:5.1f} / "
            f"{100 * r['tpot_attainment']:5.1f}  g {r['goodput_rps']:6.2f}  rot {r['rotations']:6d}")


def main(dirs: list[str]) -> None:
    print(f"{'cell':24s} {'rps':>5s}  {'stored default':40s}" + "".join(
        f"  {Path(d).name:40s}" for d in dirs) + "  best baseline g")
    for name in NAMES:
        stored = json.loads((ISSUE18 / f"{name}.json").read_text())["results"]
        runs = [{r["rps"]: r for r in json.loads((Path(d) / f"{name}.json").read_text())["results"]}
                for d in dirs]
        for rps in sorted({r["rps"] for r in stored}):
            at = [r for r in stored if r["rps"] == rps]
            lvf = next(r for r in at if r["policy"] == "lvf")
            best = max(r["goodput_rps"] for r in at if r["policy"] in BASELINES)
            print(f"{name:24s} {rps:5g}  {row(lvf):40s}" + "".join(
                f"  {row(run[rps]) if rps in run else '-':40s}" for run in runs)
                + f"  {best:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
