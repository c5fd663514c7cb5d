"""`python -m experiments prefix-cache`: prefix caching on vs off on the real stack, same load.

For each scenario, rate and repeat it starts `superinfer serve` (the bundled model, every
service its own process) once with `--enable-prefix-caching` and once with
`--no-enable-prefix-caching`, in alternating order, replays the same seeded trace with
`superinfer bench serve` (a separate client process), and stops the stack. It reports per
scenario and rate the medians over the repeats of mean TTFT, P50 TTFT and mean TPOT, the
ratio off/on of each repeat's mean TTFT (so machine noise between repeats cancels), and the
prefix cache's hits per tier as the server counted them.

Scenarios (`--scenarios`):

* `multi-turn` — chat conversations of four turns, each turn's prompt the conversation so
  far (`bench serve --multi-turn`); the default pools (everything fits on the device).
* `host-tier` — the same conversations with a device pool too small to keep their
  histories between turns: the device tier alone would miss, the host tier (eager copies)
  serves them.
* `system-prompt` — single requests behind one shared 256-token system prompt.
* `no-sharing` — single requests with nothing in common: what caching costs when it
  cannot help (the default's question).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.policies import Stack, machine_facts
from superinfer.bench.report import table

SCENARIOS: dict[str, dict[str, Any]] = {
    "multi-turn": {
        "serve": {},
        "bench": ["--endpoint", "chat", "--multi-turn", "4", "--max-prompt-len", "96",
                  "--max-output-len", "32"],
    },
    "host-tier": {
        "serve": {"device_blocks": 48},
        "bench": ["--endpoint", "chat", "--multi-turn", "4", "--max-prompt-len", "96",
                  "--max-output-len", "32"],
    },
    "system-prompt": {
        "serve": {},
        "bench": ["--system-prompt-len", "256", "--max-prompt-len", "96",
                  "--max-output-len", "32"],
    },
    "no-sharing": {
        "serve": {},
        "bench": ["--max-prompt-len", "256", "--max-output-len", "32"],
    },
}
MODES = {"on": "--enable-prefix-caching", "off": "--no-enable-prefix-caching"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--rates", default="0.5", help="request rates (req/s), comma-separated")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-blocks", type=int, default=512,
                   help="device pool of the scenarios that do not set their own (512 blocks "
                        "of 16 tokens hold every conversation of the default load)")
    p.add_argument("--host-blocks", type=int, default=2048)
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.3)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out", default=".experiments/prefix_cache",
                   help="directory for results.json, table.md and each pass's bench output")
    p.add_argument("--report", action="store_true",
                   help="run nothing: summarize the passes already in --out (a run cut short "
                        "too) into table.md, turns.md and ttft_by_turn.png")


def _stack_args(args: argparse.Namespace, scenario: dict[str, Any], mode: str
                ) -> argparse.Namespace:
    return argparse.Namespace(
        device_blocks=scenario["serve"].get("device_blocks", args.device_blocks),
        host_blocks=args.host_blocks, max_num_seqs=256, ttft_slo=args.ttft_slo,
        tbt_slo=args.tbt_slo, serve_args=MODES[mode], trace=False, out=args.out,
        startup_timeout=args.startup_timeout)


def _pass(args: argparse.Namespace, name: str, rate: float, mode: str, rep: int,
          out: Path) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    sargs = _stack_args(args, scenario, mode)
    stack = Stack("lvf", sargs, out / "run" / f"{name}-{rate:g}-{mode}-{rep}")
    path = out / f"{name}-{rate:g}-{mode}-{rep}.json"
    try:
        cmd = [sys.executable, "-m", "superinfer.cli", "bench", "serve",
               "--base-url", stack.base_url, "--num-prompts", str(args.num_prompts),
               "--rps", f"{rate:g}", "--seed", str(args.seed), "--ttft-slo", str(args.ttft_slo),
               "--tbt-slo", str(args.tbt_slo), "--no-progress", "--label", f"{name}-{mode}",
               "--json", str(path), *scenario["bench"]]
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t0
    finally:
        _stop(stack)
    (row,) = json.loads(path.read_text())["results"]
    lat = row["latency_s"]
    pc = row["server_prefix_cache"]
    return {
        "scenario": name, "rate": rate, "mode": mode, "repeat": rep, "wall_s": wall,
        "completed": row["completed"], "failed": row["failed"],
        "mean_ttft_s": lat["ttft"]["mean"], "p50_ttft_s": lat["ttft"]["p50"],
        "p99_ttft_s": lat["ttft"]["p99"], "mean_tpot_s": lat["tpot"]["mean"],
        "throughput_tok_s": row["throughput_tok_s"], "prompt_tokens": row["prompt_tokens"],
        "cached_tokens": row["cached_tokens"], "device_hits": pc["prefix_cache_hits"],
        "device_queries": pc["prefix_cache_queries"], "host_hits": pc["prefix_cache_host_hits"],
        "host_queries": pc["prefix_cache_host_queries"], "rotations": row["rotations"],
        "ttft_by_turn_s": _ttft_by_turn(row, scenario),
    }


def _turns(scenario: dict[str, Any]) -> int:
    bench = scenario["bench"]
    return int(bench[bench.index("--multi-turn") + 1]) if "--multi-turn" in bench else 1


def _ttft_by_turn(row: dict[str, Any], scenario: dict[str, Any]) -> list[float | None]:
    """Mean TTFT of each turn (request i is turn i // C, C conversations: bench serve)."""
    turns, reqs = _turns(scenario), row["per_request"]
    count = -(-len(reqs) // turns)
    out: list[float | None] = []
    for t in range(turns):
        vals = [r["ttft_s"] for r in reqs
                if r["index"] // count == t and r.get("ttft_s") is not None]
        out.append(statistics.fmean(vals) if vals else None)
    return out


def _stop(stack: Stack) -> None:
    """SIGTERM, not Stack.stop's SIGINT: a shell ignores SIGINT in the jobs it starts in the
    background, and so then does `serve` (the stack outlived a background run)."""
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(60)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait()
    stack.stop()  # closes its log


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else None


def summarize(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(p["scenario"], p["rate"]) for p in passes},
                  key=lambda k: (list(SCENARIOS).index(k[0]), k[1]))
    for name, rate in keys:
        on = [p for p in passes if (p["scenario"], p["rate"], p["mode"]) == (name, rate, "on")]
        off = [p for p in passes if (p["scenario"], p["rate"], p["mode"]) == (name, rate, "off")]
        ratios = [b["mean_ttft_s"] / a["mean_ttft_s"]
                  for a, b in zip(sorted(on, key=lambda p: p["repeat"]),
                                  sorted(off, key=lambda p: p["repeat"]), strict=False)
                  if a["mean_ttft_s"] and b["mean_ttft_s"]]
        out.append({
            "scenario": name, "rate": rate, "repeats": len(ratios),
            "ttft_ratio_off_on_median": statistics.median(ratios) if ratios else None,
            "ttft_ratios": ratios,
            **{f"{k}_{m}": _median(rows, k) for m, rows in (("on", on), ("off", off))
               for k in ("mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "mean_tpot_s",
                         "throughput_tok_s")},
            "device_hits_on": _median(on, "device_hits"), "host_hits_on": _median(on, "host_hits"),
            "device_queries_on": _median(on, "device_queries"),
            "host_queries_on": _median(on, "host_queries"),
            "failed": sum(p["failed"] for p in on + off),
            **{f"ttft_by_turn_s_{m}": _by_turn_median(rows) for m, rows in (("on", on),
                                                                           ("off", off))},
        })
    return out


def _by_turn_median(rows: list[dict[str, Any]]) -> list[float | None]:
    per: list[list[float | None]] = [r["ttft_by_turn_s"] for r in rows
                                     if r.get("ttft_by_turn_s") is not None]
    if not per or len(per) < len(rows):
        return []
    return [_median([{"v": p[t]} for p in per], "v") for t in range(len(per[0]))]


def render_turns(summary: list[dict[str, Any]]) -> str:
    rows = []
    for s in summary:
        on, off = s.get("ttft_by_turn_s_on") or [], s.get("ttft_by_turn_s_off") or []
        if len(on) < 2 or len(on) != len(off):
            continue
        for t, (a, b) in enumerate(zip(on, off, strict=True)):
            rows.append([s["scenario"], f"{s['rate']:g}", t + 1, _fmt(a), _fmt(b),
                         _fmt(b / a if a and b else None, ".2f") + "x"])
    return table(["scenario", "req/s", "turn", "mean TTFT on", "mean TTFT off", "off/on"],
                 rows) if rows else ""


def plot_turns(summary: list[dict[str, Any]], path: Path) -> bool:
    rows = [s for s in summary if len(s.get("ttft_by_turn_s_on") or []) > 1]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.4), squeeze=False)
    for ax, s in zip(axes[0], rows, strict=True):
        for m, style in (("off", "o--"), ("on", "s-")):
            ys = s[f"ttft_by_turn_s_{m}"]
            ax.plot(range(1, len(ys) + 1), ys, style, label=f"caching {m}")
        ax.set_title(f"{s['scenario']}, {s['rate']:g} req/s "
                     f"(mean {s['ttft_ratio_off_on_median'] or 0:.2f}x)")
        ax.set_xlabel("turn")
        ax.set_ylabel("mean TTFT (s), median of repeats")
        ax.set_xticks(range(1, len(s["ttft_by_turn_s_on"]) + 1))
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(out: Path) -> int:
    """Re-summarize the passes in `out` (results.json and each pass's bench output)."""
    data = json.loads((out / "results.json").read_text())
    for p in data["passes"]:
        f = out / f"{p['scenario']}-{p['rate']:g}-{p['mode']}-{p['repeat']}.json"
        if "ttft_by_turn_s" not in p and f.exists():
            (row,) = json.loads(f.read_text())["results"]
            p["ttft_by_turn_s"] = _ttft_by_turn(row, SCENARIOS[p["scenario"]])
    data["summary"] = summarize(data["passes"])
    (out / "results.json").write_text(json.dumps(data, indent=1))
    text, turns = render(data["summary"]), render_turns(data["summary"])
    print(text)
    (out / "table.md").write_text(text + "\n")
    if turns:
        print(turns)
        (out / "turns.md").write_text(turns + "\n")
    if plot_turns(data["summary"], out / "ttft_by_turn.png"):
        print(f"wrote {out / 'ttft_by_turn.png'}")
    return 0


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def render(summary: list[dict[str, Any]]) -> str:
    return table(
        ["scenario", "req/s", "mean TTFT on", "mean TTFT off", "off/on (median)",
         "P50 TTFT on", "P50 TTFT off", "TPOT on", "TPOT off", "hits device", "hits host",
         "queries (host)", "failed"],
        [[s["scenario"], f"{s['rate']:g}", _fmt(s["mean_ttft_s_on"]), _fmt(s["mean_ttft_s_off"]),
          _fmt(s["ttft_ratio_off_on_median"], ".2f") + "x", _fmt(s["p50_ttft_s_on"]),
          _fmt(s["p50_ttft_s_off"]), _fmt(s["mean_tpot_s_on"]), _fmt(s["mean_tpot_s_off"]),
          _fmt(s["device_hits_on"], ".0f"), _fmt(s["host_hits_on"], ".0f"),
          f"{_fmt(s['device_queries_on'], '.0f')} ({_fmt(s['host_queries_on'], '.0f')})",
          s["failed"]]
         for s in summary])


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.report:
        return report(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")]
    facts = machine_facts()
    passes: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for name in names:
            for rate in rates:
                order = ("on", "off") if rep % 2 == 0 else ("off", "on")
                for mode in order:
                    p = _pass(args, name, rate, mode, rep, out)
                    passes.append(p)
                    print(f"{name} {rate:g} req/s caching {mode} #{rep}: mean TTFT "
                          f"{_fmt(p['mean_ttft_s'])} s, hits device {p['device_hits']} "
                          f"host {p['host_hits']}", flush=True)
                    (out / "results.json").write_text(json.dumps(
                        {"machine": facts, "args": {k: v for k, v in vars(args).items()
                                                    if k != "func"}, "passes": passes,
                         "summary": summarize(passes)}, indent=1))
    (out / "command.txt").write_text(" ".join(["python", "-m", "experiments", "prefix-cache",
                                               *sys.argv[2:]]) + "\n")
    return report(out)
