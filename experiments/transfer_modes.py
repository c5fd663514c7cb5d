"""`python -m experiments transfer-modes`: time spent waiting on KV transfers, per DuplexKV mode.

`bench transfer` times the copy engine alone. This runs the real services under rotation
pressure once per mode (`python -m experiments policies --policies lvf --serve-args
'--transfer-mode MODE'`: the bundled model, a small device pool, one rate) and reads the
scheduler's own counters from each pass's /metrics deltas: how long the loop waited on
transfer batches per iteration, how long kvmem itself copied, and the bytes moved. Writes
`<out>/results.json`, `<out>/table.md` and, per mode, the experiment's own output in
`<out>/<mode>/`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from superinfer.bench.report import table, write_json
from superinfer.bench.server_stats import scheduler_stat

MODES = ["layer-first", "block-first", "duplex"]
COLUMNS = ["mode", "iterations", "transfer_batches", "transfer_wait_s", "wait_per_iteration_ms",
           "wait_per_batch_ms", "share_of_iteration_time", "mib_d2h", "mib_h2d",
           "kvmem_copy_s", "rotations", "ttft_attainment", "tbt_attainment"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rate", type=float, default=1.6, help="req/s: ~2x what the pool serves")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mode")
    p.add_argument("--device-blocks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".experiments/transfer_modes")
    p.add_argument("--json", default=None, help="also write the rows here")


def summarize(mode: str, row: dict[str, Any]) -> dict[str, Any]:
    """One experiment pass (bench serve's row with the server's /metrics deltas) -> a row."""
    m = row.get("stats", {}).get("server_metrics_delta")
    if not m:
        raise ValueError(f"{mode}: the pass has no server /metrics deltas (stats.server_metrics_delta)")

    def g(key: str) -> float:
        return scheduler_stat(m, key) or 0.0

    its, batches, wait = g("iterations"), g("transfers"), g("transfer_s")
    busy = g("execute_rpc_s") + wait + g("decision_s_total")  # the loop's working time
    return {
        "mode": mode,
        "iterations": int(its),
        "transfer_batches": int(batches),
        "transfer_wait_s": wait,
        "wait_per_iteration_ms": 1e3 * wait / its if its else None,
        "wait_per_batch_ms": 1e3 * wait / batches if batches else None,
        "share_of_iteration_time": wait / busy if busy else None,
        "mib_d2h": g("bytes_d2h") / 2**20,
        "mib_h2d": g("bytes_h2d") / 2**20,
        "kvmem_copy_s": g("kvmem_d2h_s") + g("kvmem_h2d_s"),
        "rotations": int(g("rotations")),
        "ttft_attainment": row.get("ttft_attainment"),
        "tbt_attainment": row.get("tbt_attainment"),
    }


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) <= 1 else f"{v:.2f}"
    return "-" if v is None else str(v)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            print(f"unknown mode {mode!r}; choose from {', '.join(MODES)}", file=sys.stderr)
            return 2
        mode_dir = out / mode
        cmd = [sys.executable, "-m", "experiments", "policies", "--policies", "lvf",
               "--rates", str(args.rate), "--duration", str(args.duration),
               "--device-blocks", str(args.device_blocks), "--seed", str(args.seed),
               "--serve-args", f"--transfer-mode {mode}", "--out", str(mode_dir)]
        print(f"== {mode}: {shlex.join(cmd[1:])}", flush=True)
        if subprocess.call(cmd) != 0:
            print(f"the experiment for {mode} failed; its logs are in {mode_dir}/.run-lvf/",
                  file=sys.stderr)
            return 1
        result = json.loads((mode_dir / "results.json").read_text())
        rows.append(summarize(mode, result["results"][0]))
    command = shlex.join(["python", "-m", "experiments", "transfer-modes", *sys.argv[2:]])
    text = table(COLUMNS, [[_cell(r[c]) for c in COLUMNS] for r in rows])
    print(text)
    payload = {"command": command, "rows": rows}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    (out / "table.md").write_text(f"`{command}`\n\n```\n{text}\n```\n")
    write_json(args.json, payload)
    print(f"wrote {out}/results.json and table.md")
    return 0
