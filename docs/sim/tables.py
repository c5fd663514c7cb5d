"""Markdown tables from `superinfer sim --json` files (used to write docs/sim/README.md).

    python docs/sim/tables.py docs/sim/fig16_gh200_96gb.json [--cols ttft,tbt,tpot,...]
"""

from __future__ import annotations

import argparse
import json

COLS = {
    "ttft": ("TTFT %", "ttft_attainment", 100, ".1f"),
    "tbt": ("TBT %", "tbt_attainment", 100, ".1f"),
    "tpot": ("TPOT %", "tpot_attainment", 100, ".1f"),
    "tbtrot": ("TBT % (rotated reqs)", "tbt_attainment_rotated", 100, ".1f"),
    "p50ttft": ("P50 TTFT s", "p50_ttft_s", 1, ".2f"),
    "p99ttft": ("P99 TTFT s", "p99_ttft_s", 1, ".2f"),
    "p50tbt": ("P50 TBT s", "p50_tbt_s", 1, ".3f"),
    "p99tbt": ("P99 TBT s", "p99_tbt_s", 1, ".3f"),
    "goodput": ("goodput req/s", "goodput_rps", 1, ".2f"),
    "tput": ("tok/s", "throughput_tok_s", 1, ".0f"),
    "rot": ("rotations", "rotations", 1, "d"),
    "xfer": ("transfer s", "stats.transfer_s", 1, ".1f"),
}


def value(row: dict, key: str) -> object:
    if key.startswith("stats."):
        return row["stats"].get(key[6:])
    return row.get(key)


def table(path: str, cols: list[str]) -> str:
    data = json.loads(open(path).read())
    head = ["RPS", "policy", *(COLS[c][0] for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["results"]:
        cells = [f"{r['rps']:g}", r["policy"]]
        for c in cols:
            _, key, scale, fmt = COLS[c]
            v = value(r, key)
            cells.append("-" if v is None else format(v * scale if scale != 1 else v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--cols", default="ttft,tbt,tpot,p99ttft,p99tbt,goodput,tput,rot")
    args = p.parse_args()
    for f in args.files:
        print(f"<!-- {f} -->")
        print(table(f, args.cols.split(",")))
        print()


if __name__ == "__main__":
    main()
