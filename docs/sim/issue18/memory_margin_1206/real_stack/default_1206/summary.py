"""The table of this folder's cells: per (seed, rate), each policy's TTFT / per-gap TBT /
TPOT attainment, good requests, vLLM goodput and rotations, and issue #18's verdict with
0.05-point ties and with exact ties (recheck.py's).

    .venv/bin/python docs/sim/issue18/memory_margin_1206/real_stack/default_1206/summary.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recheck import load, verdicts  # noqa: E402

HERE = Path(__file__).resolve().parent
ORDER = ("lvf", "waiting-first", "swapped-first")


def cell(r: dict) -> str:
    return (f"{100 * r['ttft_attainment']:.0f} / {100 * r['tbt_attainment']:.2f} / "
            f"{100 * r['tpot_attainment']:.0f}, {r['good_requests']}, {r['goodput_rps']:.3f}, "
            f"{r['rotations']}")


def main() -> int:
    print("TTFT / per-gap TBT / TPOT %, good requests, vLLM goodput, rotations\n")
    print("| seed, req/s | " + " | ".join(ORDER) + " | holds (0.05 ties) | holds (exact) |")
    print("|---" * (len(ORDER) + 3) + "|")
    for p in sorted(HERE.glob("main_*/results.json*")):
        d = load(p)
        rows = {r["policy"]: r for r in d["results"]}
        (_, seed, rate, tie, strict, _), = verdicts(d)
        print(f"| {seed}, {rate} | " + " | ".join(cell(rows[k]) for k in ORDER)
              + f" | {tie} | {strict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
