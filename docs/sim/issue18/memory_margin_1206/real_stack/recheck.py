"""Issue #18's real-stack claim, rechecked on every stored `bench experiment` result under
docs/sim/issue18 with today's check: per cell (seed, rate >= 1.5x saturation) and LVF row
(plain or variant), the verdict with 0.05-point ties (`TIE_POINTS`) and with exact ties,
so that a verdict the tie changes is listed, whichever way it goes.

    .venv/bin/python docs/sim/issue18/memory_margin_1206/real_stack/recheck.py [DIR...]
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from superinfer.bench.experiment import check_claims, mean_rows

ROOT = Path(__file__).resolve().parents[2]


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def verdicts(d: dict) -> list[tuple[str, str, float, bool, bool, list[str]]]:
    """(row, seed, rate, holds with 0.05 ties, holds exactly, exact dominators) per checked
    rate of one `bench experiment` result `d`."""
    cfg = d["config"]
    rows = [r for r in d["results"] if r.get("ttft_attainment") is not None]
    if (cfg.get("repeats") or 1) > 1:
        rows = mean_rows(rows)
    claims = check_claims(rows, cfg.get("variants") or {}, cfg.get("saturation"))
    out = []
    for label, c in [("lvf", claims["claim_issue18"]),
                     *claims["claim_issue18_variants"].items()]:
        for r in c.get("rates", []):
            out.append((label, str(cfg.get("seed")), r["rate"], r["holds"], r["holds_strict"],
                        r["dominated_by_strict"]))
    return out


def main(dirs: list[str]) -> int:
    paths = sorted(p for d in (dirs or [str(ROOT)])
                   for p in Path(d).resolve().rglob("results.json*"))
    print("| result | row | seed | req/s | holds (0.05 ties) | holds (exact) | dominated by (exact) |")
    print("|---|---|---|---|---|---|---|")
    changed = 0
    for p in paths:
        for label, seed, rate, tie, strict, dom in verdicts(load(p)):
            changed += tie != strict
            mark = " **changed**" if tie != strict else ""
            where = p.parent.relative_to(ROOT) if p.is_relative_to(ROOT) else p.parent
            print(f"| {where} | {label} | {seed} | {rate} | {tie}{mark} "
                  f"| {strict} | {', '.join(dom) or '-'} |")
    print(f"\n{changed} verdict(s) differ between the two ties")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
