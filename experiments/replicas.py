"""Two replicas behind vllm-router: the router policies on the same multi-turn load.

    python -m experiments replicas --out .experiments/replicas   # docs/results/replicas/

One deployment: `superinfer replicas` starts two replicas and vllm-router with `kv_aware`
(the replicas' KV events of both tiers); three more routers over the same replicas run
`round_robin`, `power_of_two` and `cache_aware`. Each policy gets the same load through
`superinfer bench serve --base-url <its router>` (chat conversations of four turns, each
turn's prompt the conversation so far, sent `--think-time` after the previous reply; its
own seed, so no conversation is cached before it starts), the passes interleaved over
`--repeats`. Per policy it reports, from the bench's JSON: `locality` (the share of turns
after the first that went to the replica that served the turn before, the one holding the
conversation's longest prefix), `ttft_later_turns_s` (their mean TTFT), TTFT P50/P99, TBT
P99, `prefix_hit_rate` (the client's cached tokens and the replicas' hits per tier over
the prompt tokens), `goodput`. Writes results.json and table.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

import httpx

from common.daemon import free_port
from superinfer.bench.report import table

POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
ROUTER = str(Path(sys.executable).parent / "vllm-router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32, help="requests per pass")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rps", type=float, default=1.0)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--max-output-len", type=int, default=32)
    p.add_argument("--device-blocks", type=int, default=256)
    p.add_argument("--host-blocks", type=int, default=2048)
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.3)
    p.add_argument("--kv-events-tiers", default="both", choices=["both", "device"])
    p.add_argument("--out", default=".experiments/replicas")
    p.add_argument("--report", action="store_true", help="only re-summarize --out")


def _wait(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as h:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before {url} answered")
            try:
                if h.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


def _router(policy: str, port: int, urls: list[str], log: Path) -> subprocess.Popen[bytes]:
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *urls, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
            "--health-failure-threshold", "2", "--worker-startup-check-interval", "1"]
    return subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        return _report(args, out)
    policies = args.policies.split(",")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    base, port = free_port(), free_port()
    while any(p >= 65535 for p in range(base, base + 20)):
        base = free_port()
    run_dir = out / "run"
    procs: list[subprocess.Popen[bytes]] = []
    deployment = subprocess.Popen(
        [sys.executable, "-m", "superinfer.cli", "replicas", "--replicas", "2",
         "--run-dir", str(run_dir), "--port", str(port), "--router-metrics-port",
         str(free_port()), "--replica-base-port", str(base), "--device-blocks",
         str(args.device_blocks), "--host-blocks", str(args.host_blocks),
         "--kv-events-tiers", args.kv_events_tiers, "--ttft-slo", str(args.ttft_slo),
         "--tbt-slo", str(args.tbt_slo)],
        stdout=(out / "replicas.out").open("wb"), stderr=subprocess.STDOUT, env=env)
    procs.append(deployment)
    replicas = [f"http://127.0.0.1:{base + 10 * i}" for i in range(2)]
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", 600, deployment)
        routers = {"kv_aware": f"http://127.0.0.1:{port}"}
        for policy in policies:
            if policy == "kv_aware":
                continue
            rport = free_port()
            procs.append(_router(policy, rport, replicas, out / f"router-{policy}.out"))
            routers[policy] = f"http://127.0.0.1:{rport}"
            _wait(f"{routers[policy]}/health", 60, procs[-1])
        for rep in range(args.repeats):
            order = policies[rep % len(policies):] + policies[:rep % len(policies)]
            for i, policy in enumerate(order):
                seed = 1000 * rep + POLICIES.index(policy) + 1
                path = out / f"{policy}-{rep}.json"
                cmd = [sys.executable, "-m", "superinfer.cli", "bench", "serve",
                       "--base-url", f"{routers[policy]}/v1", "--endpoint", "chat",
                       "--num-prompts", str(args.num_prompts), "--multi-turn", str(args.turns),
                       "--think-time", str(args.think_time), "--rps", f"{args.rps:g}",
                       "--max-prompt-len", str(args.max_prompt_len),
                       "--max-output-len", str(args.max_output_len), "--seed", str(seed),
                       "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
                       "--metrics-url", ",".join(f"{r}/metrics" for r in replicas),
                       "--label", policy, "--no-progress", "--json", str(path)]
                print(f"pass {rep + 1}/{args.repeats} {i + 1}/{len(order)}: {policy}",
                      flush=True)
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                time.sleep(2.0)
    finally:
        for proc in procs[1:] + procs[:1]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
    (out / "config.json").write_text(json.dumps(vars(args), indent=1))
    return _report(args, out)


def summarize(result: dict[str, Any], turns: int) -> dict[str, Any]:
    """One pass's numbers from `bench serve --json`."""
    row = result["results"][0]
    reqs = row["per_request"]
    count = -(-len(reqs) // turns)  # conversations: request i is turn i // C of i % C
    same = later = 0
    ttft_later = []
    for d in reqs:
        i = d["index"]
        if i < count:
            continue
        prev = reqs[i - count]
        later += 1
        same += int(d["replica"] is not None and d["replica"] == prev["replica"])
        if d["ttft_s"] is not None:
            ttft_later.append(d["ttft_s"])
    prompt = sum(d["prompt_tokens"] or 0 for d in reqs)
    pc = row["server_prefix_cache"]
    lat = row["latency_s"]
    return {
        "locality": same / later if later else None,
        "ttft_later_turns_s": mean(ttft_later) if ttft_later else None,
        "ttft_p50_s": lat["ttft"]["p50"], "ttft_p99_s": lat["ttft"]["p99"],
        "tbt_p99_s": lat["itl"]["p99"],
        "prefix_hit_rate": {
            "client": (row["cached_tokens"] or 0) / prompt if prompt else None,
            "device": (pc["prefix_cache_hits"] or 0) / prompt if prompt else None,
            "host": (pc["prefix_cache_host_hits"] or 0) / prompt if prompt else None,
        },
        "goodput": row["goodput_rps"],
        # Goodput's denominator is the pass's arrival span, which differs with the seed:
        # the share of requests within both SLOs compares policies directly.
        "good_share": row["good_requests"] / len(reqs) if reqs else None,
        "completed": row["completed"], "failed": row["failed"],
        "replicas": sorted({d["replica"] for d in reqs if d["replica"]}),
    }


def _report(args: argparse.Namespace, out: Path) -> int:
    turns = args.turns
    per: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*-[0-9]*.json")):
        policy = path.stem.rsplit("-", 1)[0]
        per.setdefault(policy, []).append(summarize(json.loads(path.read_text()), turns))
    if not per:
        print(f"no passes in {out}", file=sys.stderr)
        return 1

    def med(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float | None:
        vals = [(r[key][sub] if sub else r[key]) for r in rows]
        vals = [v for v in vals if v is not None]
        return median(vals) if vals else None

    results: dict[str, Any] = {}
    for policy in [p for p in POLICIES if p in per] + sorted(set(per) - set(POLICIES)):
        rows = per[policy]
        results[policy] = {
            "locality": med(rows, "locality"),
            "ttft_later_turns_s": med(rows, "ttft_later_turns_s"),
            "ttft_p50_s": med(rows, "ttft_p50_s"), "ttft_p99_s": med(rows, "ttft_p99_s"),
            "tbt_p99_s": med(rows, "tbt_p99_s"),
            "prefix_hit_rate": {t: med(rows, "prefix_hit_rate", t)
                                for t in ("client", "device", "host")},
            "goodput": med(rows, "goodput"),
            "good_share": med(rows, "good_share"),
            "passes": rows,
        }
    rr, kv = results.get("round_robin"), results.get("kv_aware")
    ratio = None
    if rr and kv and rr["ttft_later_turns_s"] and kv["ttft_later_turns_s"]:
        ratio = rr["ttft_later_turns_s"] / kv["ttft_later_turns_s"]
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    (out / "results.json").write_text(json.dumps(
        {"config": config, "ttft_later_turns_round_robin_over_kv_aware": ratio,
         "results": results}, indent=1))

    def f(v: float | None, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    rows_md = [[p, pct(r["locality"]), f(r["ttft_later_turns_s"]), f(r["ttft_p50_s"]),
                f(r["ttft_p99_s"]), f(r["tbt_p99_s"], 3), pct(r["prefix_hit_rate"]["device"]),
                pct(r["prefix_hit_rate"]["host"]), f(r["goodput"]), pct(r["good_share"])]
               for p, r in results.items()]
    text = table(["policy", "locality", "TTFT later turns (s)", "TTFT P50 (s)", "TTFT P99 (s)",
                  "TBT P99 (s)", "hits device", "hits host", "goodput (req/s)",
                  "within SLOs"], rows_md)
    (out / "table.md").write_text(text + "\n")
    print(text)
    if ratio is not None:
        print(f"mean TTFT of later turns, round_robin / kv_aware: {ratio:.2f}x")
    return 0
