"""Issue #18 item 6 on the real stack: one table and one plot from the sweeps' results.

    .venv/bin/python docs/sim/issue18/real_stack/combine.py

Reads `knee_high/results.json` (1.5x and 2x the saturation rate) and, where present,
`knee_low/results.json` (0.5x and 1x), both written by `superinfer bench experiment
--interleave` (commands in README.md), and writes `knee.md`, `knee.json` and `knee.png`
here: per policy and rate TTFT, per-gap TBT and TPOT attainment, goodput as vLLM counts it
and the every-gap variant, and where the missed time went (the server's attribution);
per rate whether LVF is on the Pareto front of (TTFT, per-gap TBT attainment) and whether
its goodput is >= every baseline's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))

from superinfer.bench.experiment import pareto_claim  # noqa: E402

POLICIES = ["lvf", "swapped-first", "waiting-first", "fcfs"]


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def share(m: dict[str, float] | None, key: str) -> str:
    if not m:
        return "-"
    total = sum(v for k, v in m.items() if k != "requests")
    return "-" if total <= 0 else f"{100 * m.get(key, 0.0) / total:.0f}"


def main() -> int:
    runs = [HERE / d / "results.json" for d in ("knee_low", "knee_high")]
    found = [json.loads(p.read_text()) for p in runs if p.exists()]
    if not found:
        print("no results yet: run the sweeps in README.md", file=sys.stderr)
        return 1
    saturation = found[-1]["config"]["saturation"]
    rows: list[dict[str, Any]] = [r for f in found for r in f["results"]]
    rows.sort(key=lambda r: (r["rps"], POLICIES.index(r["policy"])))
    rates = sorted({r["rps"] for r in rows})
    # Per rate: the Pareto/goodput check of issue #18 (pareto_claim applies it from 1.5x up;
    # below, the same check is reported for information).
    verdicts = {}
    for rate in rates:
        at = [r for r in rows if r["rps"] == rate]
        check = pareto_claim(at, rate / 1.5)["rates"][0]
        verdicts[rate] = {**check, "x_saturation": round(rate / saturation, 2),
                          "counts_for_the_claim": rate >= 1.5 * saturation - 1e-9}
    claim = pareto_claim(rows, saturation)
    head = ("| rate (x sat.) | policy | TTFT % | per-gap TBT % | TPOT % | goodput req/s "
            "| every-gap goodput | p50 / p99 TTFT s | p99 TBT s | longest gap s | rotations "
            "| TTFT-miss time: wait / rotary / compute % | gap-miss time: wait / rotary / "
            "compute % | pass began (load) |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        m = r.get("server_misses") or {}
        t, g = m.get("ttft"), m.get("tbt")
        load = r.get("load_average_at_pass") or [None]
        lines.append(
            f"| {r['rps']:g} ({r['rps'] / saturation:.2g}x) | {r['policy']} | "
            f"{pct(r['ttft_attainment'])} | {pct(r['tbt_attainment'])} | "
            f"{pct(r['tpot_attainment'])} | {r['goodput_rps']:.3f} | "
            f"{r['goodput_every_gap_rps']:.3f} | {r['p50_ttft_s']:.1f} / {r['p99_ttft_s']:.1f} | "
            f"{r['p99_tbt_s']:.2f} | {r['max_gap_s']:.1f} | {r['rotations']} | "
            f"{share(t, 'waiting')} / {share(t, 'rotary')} / {share(t, 'computing')} | "
            f"{share(g, 'waiting')} / {share(g, 'rotary')} / {share(g, 'computing')} | "
            f"{r.get('pass_started_utc', '-')} ({'-' if load[0] is None else f'{load[0]:.1f}'}) |")
    lines += ["", "| rate (x sat.) | lvf dominated by | lvf goodput | best other | holds |",
              "|---|---|---|---|---|"]
    for rate, v in verdicts.items():
        lines.append(f"| {rate:g} ({v['x_saturation']}x){'' if v['counts_for_the_claim'] else ' *'}"
                     f" | {', '.join(v['dominated_by']) or 'nobody'} | {v['goodput']:.3f} | "
                     f"{v['best_other_goodput']:.3f} | {v['holds']} |")
    lines += ["", "`*`: below 1.5x the saturation rate, for information (not the claim).", "",
              f"Claim (issue #18, rates >= 1.5x {saturation:g} req/s): holds = "
              f"**{claim['holds']}**"]
    (HERE / "knee.md").write_text("\n".join(lines) + "\n")
    (HERE / "knee.json").write_text(json.dumps(
        {"saturation_rps": saturation, "claim": claim, "per_rate": list(verdicts.values()),
         "results": [{k: v for k, v in r.items() if k not in ("per_request", "stats")}
                     for r in rows]}, indent=1, default=str))
    from superinfer.sim.plots import rate_plot

    rate_plot(rows, str(HERE / "knee.png"),
              f"real stack, bundled model, 64-block device pool; saturation {saturation:g} req/s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
