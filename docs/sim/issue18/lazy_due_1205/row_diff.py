"""LVF's rows that moved between two lvf_only.sh output directories (every must-show cell):
TTFT / per-gap TBT / TPOT %, goodput, rotations; and LVF's goodput summed over the cells.

    .venv/bin/python docs/sim/issue18/lazy_due_1205/row_diff.py BEFORE_DIR AFTER_DIR
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import must_show  # noqa: E402


def row(x: dict) -> str:
    return (f"{100 * x['ttft_attainment']:.1f}/{100 * x['tbt_attainment']:.2f}/"
            f"{100 * x['tpot_attainment']:.1f} g{x['goodput_rps']:.2f} rot{x['rotations']}")


def main(a: Path, b: Path) -> None:
    ga = gb = 0.0
    for name in must_show.RUNS + must_show.MIXED:
        if not (a / f"{name}.json").exists():
            continue
        old = {r["rps"]: r for r in json.loads((a / f"{name}.json").read_text())["results"]
               if r["policy"] == "lvf"}
        for r in json.loads((b / f"{name}.json").read_text())["results"]:
            if r["policy"] != "lvf":
                continue
            o = old[r["rps"]]
            ga += o["goodput_rps"]
            gb += r["goodput_rps"]
            if row(o) != row(r):
                print(f"  {name}@{r['rps']:g}: {row(o)} -> {row(r)}")
    print(f"goodput summed {ga:.2f} -> {gb:.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
