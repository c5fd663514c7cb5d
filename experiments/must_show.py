"""`python -m experiments must-show`: RotaSched's claims on the simulator, every policy.

Runs the 26 must-show cells (the paper's settings on a GH200, its artifact's flags, a
96 GB GH200 at the engine's defaults, Mixtral-8x7B, Llama-3-8B, and mixed SLO classes)
with `superinfer sim`, then checks each cell against LVF's bars:

* ttft_ok: LVF TTFT attainment >= min(swapped-first's + 30 points, 95 %);
* tbt_ok: LVF per-gap TBT attainment >= the best baseline's - 3 points;
* tpot_ok: LVF TPOT attainment >= swapped-first's - 5 points;
* dominated_by: baselines at least as good as LVF on both TTFT and per-gap TBT and better
  on one, by more than `TIE_POINTS` (experiments/policies.py: the real stack's rule).

Mixed SLO classes, per rate: the interactive class's TTFT / per-gap TBT / TPOT for every
policy, each LVF >= every baseline (ties within `TIE_POINTS`), and LVF's batch-class TTFT
>= 90 %.

`--seeds 0,1,2` runs every cell once per seed and reports, per cell and metric, the spread
(max - min) over the seeds: the noise a change must beat. The table shows the first seed.
Writes `<out>/must_show.md`, `<out>/must_show.json` (the checks and every policy's row per
cell and seed) and the raw `sim` JSON per cell and seed. `--compare OTHER_OUT` lists every
simulated value that differs from another run's output folder (a refactoring that keeps
behaviour must show none).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments.policies import TIE_POINTS

BASELINES = ("swapped-first", "waiting-first", "fcfs")
POLICIES = ("lvf", *BASELINES)
BASE = ["--model", "qwen2.5-32b", "--dataset", "sharegpt", "--duration", "120"]
ARTIFACT = ["--max-num-seqs", "16384", "--max-batched-tokens", "16384"]  # the paper's artifact
METRICS = ("ttft_attainment", "tbt_attainment", "tpot_attainment")

# name -> (rates, sim flags, mixed SLO classes)
CELLS: dict[str, tuple[list[str], list[str], bool]] = {
    "gh200_artifact": (["5", "8", "11", "14", "17", "20"],
                       ["--hardware", "gh200", *BASE, *ARTIFACT], False),
    "gh200_96gb_defaults": (["5", "8", "11", "14", "17", "20"],
                            ["--hardware", "gh200-96gb", *BASE], False),
    "gh200_defaults": (["14", "17", "20"], ["--hardware", "gh200", *BASE], False),
    "mixtral_artifact": (["30", "40", "50", "60"],
                         ["--hardware", "gh200", "--model", "mixtral-8x7b", "--dataset",
                          "sharegpt", "--duration", "120", *ARTIFACT], False),
    "llama3_artifact": (["40", "60", "100", "140"],
                        ["--hardware", "gh200", "--model", "llama-3-8b", "--dataset",
                         "sharegpt", "--duration", "120", *ARTIFACT], False),
    "mixed_gh200_artifact": (["20"], ["--hardware", "gh200", *BASE, *ARTIFACT,
                                      "--slo-classes", "mixed"], True),
    "mixed_gh200_96gb": (["14", "20"], ["--hardware", "gh200-96gb", *BASE,
                                        "--slo-classes", "mixed"], True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=".experiments/must_show", help="output folder")
    p.add_argument("--seeds", default="0", help="workload seeds, comma separated")
    p.add_argument("--cells", default=",".join(CELLS), help="which cells, comma separated")
    p.add_argument("--jobs", type=int, default=2, help="simulations in parallel")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="the policies to run (the checks need all four)")
    p.add_argument("--compare", default=None, metavar="OTHER_OUT",
                   help="another run's output folder: list every simulated value that differs "
                        "(exit 1 if any)")
    p.add_argument("--check-only", action="store_true",
                   help="re-check the sim JSON already in --out, run nothing")


def pct(v: float | None) -> float:
    return round(100.0 * (v or 0.0), 1)


def check(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    m = {p: [pct(rows[p][k]) for k in METRICS] for p in POLICIES}
    lvf, sf = m["lvf"], m["swapped-first"]
    best_tbt = max(m[b][1] for b in BASELINES)
    dominated = [b for b in BASELINES
                 if m[b][0] >= lvf[0] - TIE_POINTS and m[b][1] >= lvf[1] - TIE_POINTS
                 and (m[b][0] > lvf[0] + TIE_POINTS or m[b][1] > lvf[1] + TIE_POINTS)]
    return {
        "attainment": m,
        "goodput": {p: round(rows[p]["goodput_rps"], 2) for p in POLICIES},
        "ttft_ok": lvf[0] >= min(sf[0] + 30.0, 95.0),
        "tbt_ok": lvf[1] >= best_tbt - 3.0,
        "tpot_ok": lvf[2] >= sf[2] - 5.0,
        "dominated_by": dominated,
    }


def check_mixed(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    m = {p: [pct(rows[p]["per_class"]["interactive"][k]) for k in METRICS] for p in POLICIES}
    ok = [all(m["lvf"][i] >= m[b][i] - TIE_POINTS for b in BASELINES) for i in range(3)]
    batch = rows["lvf"]["per_class"]["batch"]["ttft_attainment"]
    return {"attainment": m, "ttft_ok": ok[0], "tbt_ok": ok[1], "tpot_ok": ok[2],
            "batch_ttft": pct(batch), "batch_ok": batch >= 0.9, "dominated_by": []}


def passes(c: dict[str, Any]) -> bool:
    return bool(c["ttft_ok"] and c["tbt_ok"] and c["tpot_ok"] and not c["dominated_by"]
                and c.get("batch_ok", True))


def simulate(name: str, seed: int, out: Path, jobs: int, policies: str) -> Path:
    rates, flags, _ = CELLS[name]
    path = out / f"{name}.seed{seed}.json"
    argv = ["sim", *flags, "--rps", ",".join(rates), "--seed", str(seed), "--policies",
            policies, "--jobs", str(jobs), "--json", str(path)]
    from superinfer.cli import main as cli_main

    t0 = time.monotonic()
    rc = cli_main(argv)
    if rc != 0:
        raise SystemExit(f"must-show: `superinfer {' '.join(argv)}` failed ({rc})")
    print(f"must-show: {name} seed {seed}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return path


def cell_rows(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    by_rate: dict[str, dict[str, dict[str, Any]]] = {}
    for r in json.loads(path.read_text())["results"]:
        by_rate.setdefault(f"{r['rps']:g}", {})[r["policy"]] = r
    return by_rate


def evaluate(out: Path, cells: list[str], seeds: list[int]) -> dict[str, Any]:
    """Per cell and rate: the first seed's check, every seed's rows, the spread."""
    report: dict[str, Any] = {}
    for name in cells:
        mixed = CELLS[name][2]
        per_seed = {s: cell_rows(out / f"{name}.seed{s}.json") for s in seeds}
        for rate in per_seed[seeds[0]]:
            checks = {s: (check_mixed if mixed else check)(per_seed[s][rate]) for s in seeds}
            spread = {p: [round(max(checks[s]["attainment"][p][i] for s in seeds)
                                - min(checks[s]["attainment"][p][i] for s in seeds), 1)
                          for i in range(3)] for p in POLICIES}
            report[f"{name}@{rate}"] = {
                **checks[seeds[0]], "passes": passes(checks[seeds[0]]),
                "passes_per_seed": {str(s): passes(c) for s, c in checks.items()},
                "attainment_per_seed": {str(s): c["attainment"] for s, c in checks.items()},
                "spread": spread,
            }
    return report


def table(report: dict[str, Any], seeds: list[int]) -> str:
    lines = ["TTFT / per-gap TBT / TPOT attainment in % (seed "
             f"{seeds[0]}); `spread`: LVF's max - min over seeds {seeds}.", "",
             "| cell | lvf | swapped-first | waiting-first | fcfs | TTFT ok | TBT ok | TPOT ok "
             "| dominated by | lvf spread | passes in seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(t: list[float]) -> str:
        return " / ".join(f"{x:.1f}" for x in t)

    def yes(b: bool) -> str:
        return "yes" if b else "**no**"

    for key, c in report.items():
        a = c["attainment"]
        held = sum(c["passes_per_seed"].values())
        lines.append(f"| {key} | " + " | ".join(cell(a[p]) for p in POLICIES)
                     + f" | {yes(c['ttft_ok'])} | {yes(c['tbt_ok'])} | {yes(c['tpot_ok'])} | "
                     f"{', '.join(c['dominated_by']) or '-'} | {cell(c['spread']['lvf'])} | "
                     f"{held} of {len(seeds)} |")
    n = sum(c["passes"] for c in report.values())
    lines += ["", f"{n} of {len(report)} cells pass (seed {seeds[0]})."]
    return "\n".join(lines)


WALL_CLOCK = ("decision_s_total", "decision_s_max", "wall_s")  # differ run to run


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(path.read_text())["results"]
    for r in rows:
        for k in WALL_CLOCK:
            r.get("stats", {}).pop(k, None)
    return list(rows)


def compare(out: Path, other: Path, cells: list[str], seeds: list[int]) -> list[str]:
    """Every simulated row of this run against another run's (its output folder), value
    for value, where both have the (cell, seed); the scheduler's own wall-clock times aside."""
    diffs = []
    for name in cells:
        for seed in seeds:
            mine, theirs = out / f"{name}.seed{seed}.json", other / f"{name}.seed{seed}.json"
            if not theirs.exists():
                diffs.append(f"{name} seed {seed}: not in {other}")
                continue
            a, b = _rows(mine), _rows(theirs)
            for ra, rb in zip(a, b, strict=False):
                if ra != rb:
                    keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
                    diffs.append(f"{name} seed {seed} {ra.get('policy')} @ {ra.get('rps')}: "
                                 f"{', '.join(keys)} differ")
            if len(a) != len(b):
                diffs.append(f"{name} seed {seed}: {len(a)} rows against {len(b)}")
    return diffs


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = args.cells.split(",")
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        print(f"must-show: unknown cells {unknown}; known: {', '.join(CELLS)}", file=sys.stderr)
        return 2
    if not args.check_only:
        for seed in seeds:
            for name in cells:
                simulate(name, seed, out, args.jobs, args.policies)
    report = evaluate(out, cells, seeds)
    text = table(report, seeds)
    (out / "must_show.md").write_text("# Must-show cells (simulator)\n\n" + text + "\n")
    (out / "must_show.json").write_text(json.dumps(
        {"seeds": seeds, "cells": report,
         "command": "python -m experiments must-show " + " ".join(sys.argv[2:])},
        indent=1) + "\n")
    print(text)
    if args.compare:
        diffs = compare(out, Path(args.compare), cells, seeds)
        print(f"\n{len(diffs)} differences from {args.compare}")
        for d in diffs:
            print("  " + d)
        return 1 if diffs else 0
    return 0
