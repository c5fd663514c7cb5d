"""One table of run.sh's passes: every policy's row per seed and rate, with the other LVF
builds beside them (a directory SIDE_sSEED other than main_sSEED labels its LVF passes
lvf-SIDE; the baselines keep their names wherever they ran), and whether each LVF is on
the (TTFT, per-gap TBT) Pareto front with the best goodput against the baselines (issue
#18's real-stack claim).

    .venv/bin/python docs/sim/issue18/real_stack/unknown_1205/summary.py OUTDIR [--json OUT]
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

TIE = 0.05  # points: experiment.py's Pareto check counts closer values as equal


def rows(out: Path) -> dict[tuple[str, float], dict[str, dict]]:
    """(seed, rate) -> label -> the pass's row."""
    got: dict[tuple[str, float], dict[str, dict]] = {}
    for run in sorted(out.glob("*_s*")):
        side, seed = run.name.split("_s")
        for path in sorted(run.glob("*@*.json*")):  # stored gzipped in the docs
            text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text()
            for r in json.loads(text)["results"]:
                lvf = r["policy"].startswith("lvf")
                label = r["policy"] + ("" if side == "main" or not lvf else f"-{side}")
                got.setdefault((seed, r["rps"]), {})[label] = r
    return got


def pct(r: dict, key: str) -> float:
    return 100.0 * r[key]


def claim(cell: dict[str, dict], lvf: str) -> dict:
    me = cell[lvf]
    others = [p for p in cell if not p.startswith("lvf")]
    dominated = [p for p in others
                 if pct(cell[p], "ttft_attainment") >= pct(me, "ttft_attainment") - TIE
                 and pct(cell[p], "tbt_attainment") >= pct(me, "tbt_attainment") - TIE
                 and (pct(cell[p], "ttft_attainment") > pct(me, "ttft_attainment") + TIE
                      or pct(cell[p], "tbt_attainment") > pct(me, "tbt_attainment") + TIE)]
    better_goodput = [p for p in others if cell[p]["goodput_rps"] > me["goodput_rps"]]
    return {"dominated_by": dominated, "better_goodput": better_goodput,
            "holds": not dominated and not better_goodput}


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    table = rows(out)
    lines = ["| seed | req/s | policy | TTFT % | per-gap TBT % | TPOT % | goodput | rotations "
             "| longest gap s |", "|---|---|---|---|---|---|---|---|---|"]
    verdicts = {}
    for (seed, rps), cell in sorted(table.items()):
        lvfs = sorted(p for p in cell if p.startswith("lvf"))
        for label in (*lvfs, "swapped-first", "waiting-first", "fcfs"):
            r = cell.get(label)
            if r is None:
                continue
            lines.append(f"| {seed} | {rps:g} | {label} | {pct(r, 'ttft_attainment'):.1f} | "
                         f"{pct(r, 'tbt_attainment'):.1f} | {pct(r, 'tpot_attainment'):.1f} | "
                         f"{r['goodput_rps']:.3f} | {r['rotations']} | {r['max_gap_s']:.1f} |")
        verdicts[f"{seed}@{rps:g}"] = {lvf: claim(cell, lvf) for lvf in lvfs}
    print("\n".join(lines))
    for k, v in verdicts.items():
        print(k, json.dumps(v))
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(
            {"verdicts": verdicts, "table": lines}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
