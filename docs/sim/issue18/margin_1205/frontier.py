"""Every must-show cell against LVF's `vlt_margin` (the hysteresis a victim must lag by).

    .venv/bin/python docs/sim/issue18/margin_1205/frontier.py MARGIN=DIR... [--png OUT]
        [--json OUT]

Each DIR holds lazy_1202/lvf_only.sh's JSON for one margin (`EXTRA="--vlt-margin M"`);
margin 0 (the default) is read from the stored rows of docs/sim/issue18/<name>.json. Prints,
per cell, what LVF gets at each margin and which of the issue's thresholds it misses
(alpha_1204/score.py's checks), then how many cells each margin fails and its goodput sum.
The PNG puts LVF's TTFT against its TPOT at each margin, with the baselines and the region
where the cell's TTFT and TPOT thresholds both hold, for the cells that fail at some margin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ISSUE18 = HERE.parent
sys.path.insert(0, str(ISSUE18))
sys.path.insert(0, str(ISSUE18 / "alpha_1204"))
import must_show  # noqa: E402
import score  # noqa: E402


def cells(run_dir: Path) -> dict[str, dict]:
    """'name @ rps' -> LVF's row of that run, with the stored baselines' rows."""
    out = {}
    # (the mixed cells are per class: score.py covers them)
    for name, r, rows, _ in score.lvf_cells(run_dir, must_show.RUNS):
        out[f"{name} @ {r['rps']:g}"] = must_show.check(rows)
    return out


def main(argv: list[str]) -> None:
    png = js = None
    for flag in ("--png", "--json"):
        if flag in argv:
            i = argv.index(flag)
            if flag == "--png":
                png = Path(argv[i + 1])
            else:
                js = Path(argv[i + 1])
            argv = argv[:i] + argv[i + 2:]
    runs = {0.0: ISSUE18}
    for a in argv:
        m, d = a.split("=", 1)
        runs[float(m)] = Path(d)
    margins = sorted(runs)
    per = {m: cells(runs[m]) for m in margins}
    scores = {m: score.score(runs[m]) for m in margins}
    names = [c for c in per[0.0] if any(c in per[m] for m in margins)]
    failing_somewhere = []
    print("LVF TTFT / per-gap TBT / TPOT % and goodput per margin; the thresholds it misses")
    for c in names:
        line = [f"{c}:"]
        bad_any = False
        for m in margins:
            k = per[m].get(c)
            if k is None:
                continue
            bad = score.misses(k)
            bad_any |= bool(bad)
            t = " / ".join(f"{x:.1f}" for x in k["lvf"])
            line.append(f"  m {m:g}: {t}, {k['goodput']['lvf']:.2f}"
                        + (f"  MISSES {', '.join(bad)}" if bad else "  ok"))
        if bad_any:
            failing_somewhere.append(c)
            print("\n".join(line))
    print()
    print("margin  failing cells (of all 26)  LVF goodput summed")
    for m in margins:
        s = scores[m]
        print(f"{m:6g}  {len(s['failing']):>2} of {s['cells']:<21} {s['goodput_sum']:.2f}")
        for f in s["failing"]:
            print(f"          {f}")
    if js is not None:
        js.write_text(json.dumps({"margins": margins, "scores": {str(m): scores[m] for m in margins},
                                  "cells": {c: {str(m): per[m][c] for m in margins if c in per[m]}
                                            for c in names}}, indent=1) + "\n")
    if png is not None:
        plot(png, failing_somewhere, margins, per)


def plot(png: Path, names: list[str], margins: list[float], per: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
    marks = {"swapped-first": "s", "waiting-first": "^", "fcfs": "x"}
    for ax, c in zip(axes.flat, names):
        k0 = per[0.0][c]
        sf = k0["swapped-first"]
        ttft_min, tpot_min = min(sf[0] + 30.0, 95.0), sf[2] - 5.0
        ax.axvspan(ttft_min, 101, ymin=0, ymax=1, color="0.93")
        ax.axvline(ttft_min, color="0.5", lw=0.8, ls="--")
        ax.axhline(tpot_min, color="0.5", lw=0.8, ls="--")
        pts = [(m, per[m][c]["lvf"]) for m in margins if c in per[m]]
        ax.plot([p[1][0] for p in pts], [p[1][2] for p in pts], "o-", color="C0", label="lvf")
        for m, (ttft, _, tpot) in pts:
            ax.annotate(f"{m:g}", (ttft, tpot), textcoords="offset points", xytext=(4, 3),
                        fontsize=7)
        for b, mk in marks.items():
            t = k0[b]
            ax.plot([t[0]], [t[2]], mk, color="C3" if b == "waiting-first" else "C2",
                    label=b, ms=6)
        ax.set_title(c, fontsize=9)
        ax.set_xlabel("TTFT attainment %")
        ax.set_ylabel("TPOT attainment %")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("LVF's vlt_margin (labels, in TTFT SLOs) against the issue's TTFT / TPOT "
                 "thresholds (dashed; both hold up and right)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
