"""Score LVF-only runs (lazy_1202/lvf_only.sh's JSON) against the stored baselines.

    .venv/bin/python docs/sim/issue18/alpha_1204/score.py DIR... [--json OUT]

For each DIR: the must-show cells it fails (must_show.py's checks, with the baselines'
rows of docs/sim/issue18/<name>.json and the LVF rows of DIR/<name>.json) and the sum of
LVF's goodput over every cell DIR has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ISSUE18 = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ISSUE18))
import must_show  # noqa: E402


def lvf_cells(run_dir: Path, names: tuple[str, ...]):
    """(name, LVF's row of run_dir, the stored rows of that cell with that LVF row in
    place of the stored one, the stored LVF row) for every LVF row of run_dir/<name>.json."""
    for name in names:
        path = run_dir / f"{name}.json"
        if not path.exists():
            continue
        base: dict[float, dict[str, dict]] = {}
        for r in json.loads((ISSUE18 / f"{name}.json").read_text())["results"]:
            base.setdefault(r["rps"], {})[r["policy"]] = r
        for r in json.loads(path.read_text())["results"]:
            if r["policy"] != "lvf":
                continue  # a stored run's baselines
            rows = dict(base[r["rps"]])
            stored = rows["lvf"]
            rows["lvf"] = r
            yield name, r, rows, stored


def misses(c: dict) -> list[str]:
    """The thresholds a must_show.check() result misses, and who dominates LVF."""
    return ([k[:-3] for k in ("ttft_ok", "tbt_ok", "tpot_ok") if not c[k]]
            + [f"dominated by {b}" for b in c["dominated_by"]])


def score(run_dir: Path) -> dict:
    fails: list[str] = []
    goodput = stored = 0.0
    cells = 0
    for name, r, rows, kept in lvf_cells(run_dir, must_show.RUNS + must_show.MIXED):
        stored += kept["goodput_rps"]
        goodput += r["goodput_rps"]
        cells += 1
        if name in must_show.MIXED:
            c = must_show.check_mixed(rows)
            bad = [k for k, ok in zip(("ttft", "tbt", "tpot"), c["interactive_ok"]) if not ok]
            bad += [] if c["batch_ok"] else ["batch"]
            got = c["interactive"]["lvf"]
        else:
            c = must_show.check(rows)
            bad = misses(c)
            got = c["lvf"]
        if bad:
            fails.append(f"{name} @ {r['rps']:g}: {', '.join(bad)} "
                         f"(LVF {' / '.join(f'{x:.1f}' for x in got)})")
    return {"dir": str(run_dir), "cells": cells, "failing": fails,
            "goodput_sum": round(goodput, 2), "stored_default_goodput_sum": round(stored, 2)}


def main(argv: list[str]) -> None:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    results = [score(Path(d)) for d in argv]
    for s in results:
        print(f"{s['dir']}: {len(s['failing'])} of {s['cells']} cells fail; LVF goodput summed "
              f"{s['goodput_sum']:.2f} req/s (stored default {s['stored_default_goodput_sum']:.2f})")
        for f in s["failing"]:
            print(f"    {f}")
    if out is not None:
        out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
