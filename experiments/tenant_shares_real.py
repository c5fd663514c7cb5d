"""Fair shares on the real stack: an interactive tenant under a flooding one, shares vs global.

For each fairness (`--fairness`, default `shares,global`) it starts the four real services
as `superinfer serve` does, with a tenants file of two tenants (A, B; keys made here, only
their hashes in the file) and its scheduler child run through `python -m
experiments.rules_scheduler --rules fairness=F` (the only place the order across tenants is
set: the server has no such setting). On each stack it runs, `--repeats` times, with a
new seed each time:

* `solo`: A alone (its requests at `--a-rps`), and
* `flood`: A as in solo (the same trace) and B flooding at `--b-rps` with longer requests,

each through `superinfer bench serve --tenant` as a separate client process, and reads
A's TTFT and TBT attainment and p99 TTFT from the bench (the server's own counts agree
within one request: docs/results/tenants/). The noise is the spread (max - min) of each
figure over the repeats; the check: under `shares` A's flood attainment stays nearer its
solo attainment than under `global`, by more than that spread.

Workload (the CPU stack of docs/results/rotasched/'s real cells, memory the bottleneck):
the bundled model, `--device-blocks 64 --host-blocks 4096 --max-num-seqs 32
--no-enable-prefix-caching`; A: ShareGPT-like prompts up to 128 tokens, outputs up to 32,
SLOs TTFT 3 s / TBT 300 ms; B: prompts up to 384, outputs up to 128, the same SLOs by
default (with looser ones, LVF's own lag order already serves A first: a first run with
B at 30 s / 1 s showed A at 100 % under both orders). Equal weights.

    python -m experiments tenant-shares-real --out .experiments/tenant_shares_real

writes `<out>/results.json` (per fairness and repeat: A's figures solo and flood, B's),
`<out>/table.md`, and the bench outputs and stack logs beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINE = ["--policy", "lvf", "--device-blocks", "64", "--host-blocks", "4096",
          "--max-num-seqs", "32", "--no-enable-prefix-caching"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=".experiments/tenant_shares_real")
    p.add_argument("--fairness", default="shares,global", help="comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--a-rps", type=float, default=0.4)
    p.add_argument("--a-prompts", type=int, default=12)
    p.add_argument("--b-rps", type=float, default=1.5)
    p.add_argument("--b-prompts", type=int, default=30)
    # B's SLOs as tight as A's by default: LVF then ranks B's backlog with A's requests
    # by lag alone (with looser ones for B, LVF's own order already puts A first).
    p.add_argument("--b-ttft-slo", type=float, default=3.0)
    p.add_argument("--b-tbt-slo", type=float, default=0.3)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--resummarize", action="store_true",
                   help="recompute the summary of <out>/results.json, run nothing")


def tenant_specs(args: argparse.Namespace, flood: bool) -> list[str]:
    a = (f"name=A,key-env=TENANT_KEY_A,rps={args.a_rps},num-prompts={args.a_prompts},"
         "max-prompt-len=128,max-output-len=32,ttft-slo=3,tbt-slo=0.3")
    b = (f"name=B,key-env=TENANT_KEY_B,rps={args.b_rps},num-prompts={args.b_prompts},"
         f"max-prompt-len=384,max-output-len=128,ttft-slo={args.b_ttft_slo:g},"
         f"tbt-slo={args.b_tbt_slo:g}")
    return ["--tenant", a, *(["--tenant", b] if flood else [])]


def figures(bench: dict[str, Any], tenant: str) -> dict[str, Any]:
    row = next(r for r in bench["tenants"] if r["tenant"] == tenant)
    c = row["counts"]["bench"]
    return {
        "ttft": c["ttft_met"] / max(1, c["ttft_met"] + c["ttft_missed"]),
        "tbt": c["tbt_met"] / max(1, c["tbt_met"] + c["tbt_missed"]),
        "p99_ttft_s": row["p99_ttft_s"], "good": c["good"], "requests": row["requests"],
        "server": row["counts"]["server"], "agree": row["agree"], "blame_s": row.get("blame_s"),
    }


def run(args: argparse.Namespace) -> int:
    if args.resummarize:
        path = Path(args.out) / "results.json"
        data = json.loads(path.read_text())
        data["summary"] = summarize(data["runs"])
        path.write_text(json.dumps(data, indent=1))
        print(format_table(data["summary"]))
        return 0
    from common.tenants import hash_key, new_key
    from experiments.policies import Stack
    from experiments.rate_step_real import serve_command

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    keys = {"A": new_key(), "B": new_key()}
    tenants = out / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{t}]\nkeys = ["{hash_key(k)}"]\n\n'
                               for t, k in keys.items()))
    env = {**os.environ, "TENANT_KEY_A": keys["A"], "TENANT_KEY_B": keys["B"]}
    env.pop("SUPERINFER_API_KEY", None)
    results: dict[str, list[dict[str, Any]]] = {}

    class FairStack(Stack):
        def __init__(self, fairness: str, run_dir: Path) -> None:  # noqa: D107
            from common.daemon import free_port

            self.port = free_port()
            ports = [str(free_port()) for _ in range(4)]
            argv = serve_command(f"fairness={fairness}", [
                "--port", str(self.port), "--grpc-port", ports[0], "--scheduler-port",
                ports[1], "--worker-port", ports[2], "--kvmem-port", ports[3],
                "--run-dir", str(run_dir), "--max-restarts", "0", "--tenants", str(tenants),
                *ENGINE])
            run_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(run_dir / "serve.out", "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=env)
            self.base_url = f"http://127.0.0.1:{self.port}/v1"
            try:
                self._wait_ready(fairness, args.startup_timeout, run_dir)
            except BaseException:
                self.stop()
                raise

    for fairness in [f.strip() for f in args.fairness.split(",") if f.strip()]:
        stack = FairStack(fairness, out / f".run-{fairness}")
        try:
            runs = results[fairness] = []
            for r in range(args.repeats):
                entry: dict[str, Any] = {"repeat": r, "seed": 100 + r}
                for kind in ("solo", "flood"):
                    path = out / f"{fairness}.{kind}.{r}.json"
                    t0 = time.perf_counter()
                    proc = subprocess.run(
                        [sys.executable, "-m", "superinfer.cli", "bench", "serve",
                         "--base-url", stack.base_url, "--dataset", "sharegpt",
                         "--seed", str(100 + r), "--no-progress", "--json", str(path),
                         *tenant_specs(args, kind == "flood")],
                        env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise RuntimeError(f"bench serve failed: {proc.stderr[-2000:]}")
                    bench = json.loads(path.read_text())
                    entry[kind] = {"A": figures(bench, "A"), "wall_s": time.perf_counter() - t0}
                    if kind == "flood":
                        entry[kind]["B"] = figures(bench, "B")
                    print(f"{fairness} repeat {r} {kind}: A TTFT "
                          f"{100 * entry[kind]['A']['ttft']:.0f} %, TBT "
                          f"{100 * entry[kind]['A']['tbt']:.1f} %, p99 TTFT "
                          f"{entry[kind]['A']['p99_ttft_s']:.2f} s", flush=True)
                runs.append(entry)
        finally:
            stack.stop()
    summary = summarize(results)
    (out / "results.json").write_text(json.dumps(
        {"command": "python -m experiments tenant-shares-real " + " ".join(sys.argv[2:]),
         "config": {k: v for k, v in vars(args).items() if k != "func"}, "engine": ENGINE,
         "runs": results, "summary": summary}, indent=1))
    table = format_table(summary)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per fairness: A's mean loss (solo - flood) in TTFT and TBT attainment, its p99 TTFT
    ratio, and the spread of each over the repeats (the noise)."""
    out: dict[str, Any] = {}
    for fairness, runs in results.items():
        def series(f: Any, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [f(r) for r in runs]

        loss_ttft = series(lambda r: r["solo"]["A"]["ttft"] - r["flood"]["A"]["ttft"])
        loss_tbt = series(lambda r: r["solo"]["A"]["tbt"] - r["flood"]["A"]["tbt"])
        ratio = series(lambda r: r["flood"]["A"]["p99_ttft_s"] / max(r["solo"]["A"]["p99_ttft_s"], 1e-9))
        solo = series(lambda r: r["solo"]["A"]["ttft"])
        out[fairness] = {
            "a_ttft_loss": sum(loss_ttft) / len(runs), "a_ttft_loss_spread": max(loss_ttft) - min(loss_ttft),
            "a_tbt_loss": sum(loss_tbt) / len(runs), "a_tbt_loss_spread": max(loss_tbt) - min(loss_tbt),
            "a_p99_ttft_ratio": sum(ratio) / len(runs),
            "a_p99_ttft_ratio_spread": max(ratio) - min(ratio),
            "a_ttft_solo_spread": max(solo) - min(solo),
            "a_ttft_solo": sum(solo) / len(runs),
            "a_ttft_flood": sum(series(lambda r: r["flood"]["A"]["ttft"])) / len(runs),
            "a_tbt_solo": sum(series(lambda r: r["solo"]["A"]["tbt"])) / len(runs),
            "a_tbt_flood": sum(series(lambda r: r["flood"]["A"]["tbt"])) / len(runs),
            "b_ttft_flood": sum(series(lambda r: r["flood"]["B"]["ttft"])) / len(runs),
            "policy": fairness, "where": "real",
        }
    if {"shares", "global"} <= set(out):
        s, g = out["shares"], out["global"]
        noise = max(s["a_ttft_loss_spread"], g["a_ttft_loss_spread"])
        gap = g["a_ttft_loss"] - s["a_ttft_loss"]
        # The same seed per repeat under both orders: the gap repeat by repeat.
        paired = [(gr["solo"]["A"]["ttft"] - gr["flood"]["A"]["ttft"])
                  - (sr["solo"]["A"]["ttft"] - sr["flood"]["A"]["ttft"])
                  for sr, gr in zip(results["shares"], results["global"], strict=False)]
        out["check"] = {
            "a_ttft_loss_gap": gap, "noise": noise,
            "shares_better_beyond_noise": gap > noise + 1e-9,
            "paired_gaps": paired, "shares_better_every_repeat": all(d > 0 for d in paired),
        }
    return out


def format_table(summary: dict[str, Any]) -> str:
    rows = ["| fairness | A TTFT solo | A TTFT flood | loss (spread) | A TBT solo | A TBT flood "
            "| A p99 TTFT flood/solo (spread) | B TTFT flood |", "|---|---|---|---|---|---|---|---|"]
    for f, s in summary.items():
        if f == "check":
            continue
        rows.append(
            f"| {f} | {100 * s['a_ttft_solo']:.1f} % | {100 * s['a_ttft_flood']:.1f} % | "
            f"{100 * s['a_ttft_loss']:.1f} ({100 * s['a_ttft_loss_spread']:.1f}) | "
            f"{100 * s['a_tbt_solo']:.1f} % | {100 * s['a_tbt_flood']:.1f} % | "
            f"{s['a_p99_ttft_ratio']:.2f} ({s['a_p99_ttft_ratio_spread']:.2f}) | "
            f"{100 * s['b_ttft_flood']:.1f} % |")
    if "check" in summary:
        c = summary["check"]
        rows.append(f"\nA's TTFT loss, global minus shares: {100 * c['a_ttft_loss_gap']:.1f} "
                    f"points; noise (the larger spread): {100 * c['noise']:.1f}; beyond the "
                    f"noise: {c['shares_better_beyond_noise']}; repeat by repeat (same seed): "
                    + ", ".join(f"{100 * d:.1f}" for d in c["paired_gaps"]))
    return "\n".join(rows)
