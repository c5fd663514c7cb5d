"""LVF's must-show cells now against the committed noise table of an earlier default.

`docs/results/rotasched/results.json` holds `must_show_noise`: every must-show cell, rate
and seed at the defaults before a change, with each policy's spread (max - min over the
seeds) in points. This reads a `must-show` run of the current code (`--run`, any policies,
LVF needed) and prints, per cell and rate, LVF's attainment (TTFT / per-gap TBT / TPOT)
before and after for each seed, the change of the seeds' mean, and whether any metric
fell by more than that cell's spread. Writes the rows as JSON.

    python -m experiments must-show --policies lvf --seeds 0,1,2 --out .experiments/ms_new
    python -m experiments defaults-diff --run .experiments/ms_new --json diff.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments.must_show import CELLS, cell_rows

NOISE = Path(__file__).resolve().parent.parent / "docs" / "results" / "rotasched" / "results.json"
METRICS = ("ttft", "tbt", "tpot")
# The must-show check rounds attainment to 0.1 points: a fall of less than half of that
# is no change.
ROUNDING = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="a must-show --out folder of the current code")
    p.add_argument("--noise", default=str(NOISE), help="the results.json with must_show_noise")
    p.add_argument("--policy", default="lvf")
    p.add_argument("--json", default=None, metavar="PATH")


def _attainment(row: dict[str, Any], cell: str) -> dict[str, float]:
    src = row["per_class"]["interactive"] if cell.startswith("mixed") else row
    return {m: 100.0 * float(src[f"{m}_attainment"] or 0.0) for m in METRICS}


def diff(run: Path, noise: dict[str, Any], policy: str) -> list[dict[str, Any]]:
    old: dict[tuple[str, float], dict[int, dict[str, float]]] = {}
    for r in noise["rows"]:
        if r["policy"] == policy:
            old.setdefault((r["cell"], float(r["rps"])), {})[int(r["seed"])] = {
                m: 100.0 * r[f"{m}_attainment"] for m in METRICS}
    spread = {(s["cell"], float(s["rps"])): {m: s[f"{m}_spread_points"] for m in METRICS}
              for s in noise["spread"] if s["policy"] == policy}
    rows = []
    for cell in CELLS:
        for path in sorted(run.glob(f"{cell}.seed*.json")):
            seed = int(path.name.split(".seed")[1].split(".")[0])
            for rate, by_policy in cell_rows(path).items():
                key = (cell, float(rate))
                if policy not in by_policy or seed not in old.get(key, {}):
                    continue
                rows.append({"cell": cell, "rps": float(rate), "seed": seed,
                             "before": old[key][seed],
                             "after": _attainment(by_policy[policy], cell),
                             "spread": spread[key]})
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["cell"], r["rps"]), []).append(r)
    out = []
    for (cell, rps), rs in cells.items():
        n = len(rs)
        mean = {side: {m: sum(r[side][m] for r in rs) / n for m in METRICS}
                for side in ("before", "after")}
        change = {m: mean["after"][m] - mean["before"][m] for m in METRICS}
        worse = [m for m in METRICS if change[m] < -rs[0]["spread"][m] - ROUNDING]
        out.append({"cell": cell, "rps": rps, "seeds": n, "before": mean["before"],
                    "after": mean["after"], "change_points": change,
                    "spread_points": rs[0]["spread"], "worse_than_spread": worse})
    return out


def run(args: argparse.Namespace) -> int:
    noise = json.loads(Path(args.noise).read_text())["must_show_noise"]
    rows = diff(Path(args.run), noise, args.policy)
    if not rows:
        print(f"defaults-diff: no {args.policy} rows in {args.run} match the noise table")
        return 2
    cells = summarize(rows)
    print(f"{args.policy}: mean over seeds, TTFT / per-gap TBT / TPOT %, before -> after "
          f"(change; spread at the old defaults)")
    for c in cells:
        b, a, d, s = c["before"], c["after"], c["change_points"], c["spread_points"]
        flag = "  WORSE: " + ",".join(c["worse_than_spread"]) if c["worse_than_spread"] else ""
        print(f"{c['cell']:>22} {c['rps']:>5g}: "
              + " / ".join(f"{b[m]:.1f}" for m in METRICS) + " -> "
              + " / ".join(f"{a[m]:.1f}" for m in METRICS)
              + "  (" + " / ".join(f"{d[m]:+.1f}" for m in METRICS) + "; "
              + " / ".join(f"{s[m]:.1f}" for m in METRICS) + ")" + flag)
    worse = [c for c in cells if c["worse_than_spread"]]
    changed = [c for c in cells if any(abs(v) >= ROUNDING for v in c["change_points"].values())]
    print(f"\n{len(cells)} cell-rates, {len(changed)} changed, {len(worse)} worse by more than "
          f"their spread")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cells": cells}, indent=1) + "\n")
    return 0
