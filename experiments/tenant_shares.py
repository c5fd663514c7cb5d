"""`python -m experiments tenant-shares`: fair shares across tenants, in the simulator.

Two tenants on the must-show cell `gh200_artifact` (GH200, Qwen2.5-32B, ShareGPT-like
lengths, the paper artifact's flags), equal weights:

* A, interactive: normal lengths, SLOs TTFT 2 s / TBT 100 ms, at about half its share;
* B, long requests (lengths x2), SLOs TTFT 10 s / TBT 200 ms, at about 3x its share.

Scenarios (scheduler_svc/policy/shares.py is what they test):

1. flood: A alone vs A + B, under `shares`, `global` (LVF's order, no fairness) and `vtc`
   (tokens only). A under `shares` must keep its attainment (within 3 points) and its
   p99 TTFT (<= 1.2x alone); `global` must lose >= 10 points (else the load is too light).
2. on/off: A on for 30 s, off for 30 s, B continuous; B's output tok/s in A's off phases
   over B alone's in the same windows (work conservation, >= 0.95), and A's TTFT in the
   first 5 s of each on phase against its on phases overall.
3. rotation: the device pool cut to a quarter of the flood's working set (its peak device
   blocks in use), `shares` vs `vtc`: each tenant's share of tokens and block-seconds.
4. blame: whom A's missed intervals name under `global`; the roles swapped (names
   relabelled); A bursting at 2.5x its capacity with B a trickle (the run the results page
   reports; blame now also accrues with one named tenant alone: tests/test_shares.py).

`--sweep` runs the capacity sweep the rates were chosen from (each tenant alone). Writes
`<out>/results.json`; `--check` prints which thresholds hold (exit 1 if one does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from experiments.must_show import CELLS
from superinfer.sim import cli as sim_cli
from superinfer.sim.engine import PolicyVariant, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.slo_metrics import RequestRecord, compute_metrics
from superinfer.workload import SLOClass, TraceRequest, build_trace

CELL = "gh200_artifact"
SLO_A = SLOClass("a", 2.0, 0.1, 1.0)
SLO_B = SLOClass("b", 10.0, 0.2, 1.0)
SCALE_B = 2.0  # B's lengths
# Capacities (req/s, each tenant alone): the highest swept rate whose p99 TTFT is within
# the SLO (`--sweep`; one step up, throughput flattens at ~3,900 tok/s and TTFT fails).
CAP_A = 24.0
CAP_B = 20.0
RATE_A = CAP_A / 4  # half of its half share
RATE_B = CAP_B * 1.5  # three times its half share
PERIOD_S = 30.0  # on/off: A's half period
HEAD_S = 5.0  # on/off: the start of an on phase
POLICIES = ("shares", "global", "vtc")
SWEEP = {"A": (8.0, 16.0, 24.0, 28.0, 32.0, 40.0), "B": (5.0, 10.0, 15.0, 20.0, 25.0, 30.0)}

# Thresholds (--check)
ATTAIN_POINTS = 3.0  # shares: A's attainment under flood within this of alone
P99_RATIO = 1.2  # shares: A's p99 TTFT under flood / alone
GLOBAL_LOSS = 10.0  # global must lose at least this many points for A
WORK_CONSERVATION = 0.95


def cell_args(extra: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    return p.parse_args([*CELLS[CELL][1], *(extra or [])])


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    rate: float
    slo: SLOClass
    scale: float = 1.0
    on_off_s: float | None = None  # arrivals only in [0, p), [2p, 3p), ...
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    key: str
    tenants: tuple[Tenant, ...]
    fairness: str
    duration_s: float
    device_blocks: int | None = None
    windows: tuple[tuple[float, float], ...] = ()  # B's throughput is measured in these


def on_windows(period: float, duration: float, on: bool) -> list[tuple[float, float]]:
    start = 0.0 if on else period
    return [(t, min(t + period, duration)) for t in _frange(start, duration, 2 * period)]


def _frange(a: float, b: float, step: float) -> list[float]:
    out = []
    while a < b:
        out.append(a)
        a += step
    return out


def tenant_trace(args: argparse.Namespace, t: Tenant, duration: float) -> list[TraceRequest]:
    spec = dataclasses.replace(sim_cli.workload_spec(args, t.rate), duration_s=duration,
                               num_prompts=None, seed=t.seed, length_scale=t.scale)
    out = [dataclasses.replace(r, tenant=t.name, slo=t.slo) for r in build_trace(spec)]
    if t.on_off_s is not None:  # a Poisson stream thinned to the on phases stays Poisson
        p = t.on_off_s
        out = [r for r in out if int(r.arrival_s // p) % 2 == 0]
    return out


def merged_trace(args: argparse.Namespace, job: Job) -> list[TraceRequest]:
    rs = sorted((r for t in job.tenants for r in tenant_trace(args, t, job.duration_s)),
                key=lambda r: r.arrival_s)
    return [dataclasses.replace(r, index=i) for i, r in enumerate(rs)]


class PeakSimulator(Simulator):
    """The simulator, noting the most device blocks in use at any plan."""

    peak_blocks = 0

    def make_scheduler(self, clock: Callable[[], float]) -> Any:
        sched = super().make_scheduler(clock)
        inner, bm = sched.schedule, sched.bm  # type: ignore[attr-defined]

        def schedule() -> Any:
            used = self.device_blocks - bm.num_free_device
            self.peak_blocks = max(self.peak_blocks, used)
            return inner()

        sched.schedule = schedule  # type: ignore[method-assign]
        return sched


def tokens_in(records: list[RequestRecord], windows: list[tuple[float, float]]
              ) -> tuple[float, float]:
    """(output tokens, prompt + output tokens) per second inside the windows; a prompt
    counts when its first token comes (the work the device did, not only what it sampled)."""
    span = sum(b - a for a, b in windows)

    def inside(x: float) -> bool:
        return any(a <= x < b for a, b in windows)

    out = sum(1 for r in records for x in r.token_times if inside(x))
    prompt = sum(r.prompt_tokens for r in records if r.token_times and inside(r.token_times[0]))
    return (out / span, (out + prompt) / span) if span else (math.nan, math.nan)


def tenant_summary(recs: list[RequestRecord], duration: float) -> dict[str, Any]:
    m = compute_metrics(recs, duration)
    blame: dict[str, float] = {}
    for r in recs:
        for k, v in (r.blame or {}).items():
            blame[k] = blame.get(k, 0.0) + v
    return {"requests": m.requests, "ttft": m.ttft_attainment, "tbt": m.tbt_attainment,
            "p99_ttft_s": m.p99_ttft_s, "p50_ttft_s": m.p50_ttft_s,
            "throughput_tok_s": m.throughput_tok_s,
            "unfinished": sum(not r.finished for r in recs), "blame_s": blame}


def run_job(job: Job) -> dict[str, Any]:
    """One simulation, reduced to per-tenant rows (a process of its own under --jobs)."""
    args = cell_args()
    hw, model = load_hardware(args.hardware), load_model(args.model)
    cfg = sim_cli.build_config(args)
    if job.device_blocks is not None:
        cfg = dataclasses.replace(cfg, device_blocks=job.device_blocks)
    v = PolicyVariant.parse(f"lvf:fairness={job.fairness}")
    sim = PeakSimulator(hw, model, v.policy, v.apply(cfg), label=job.key)
    trace = merged_trace(args, job)
    t0 = time.perf_counter()
    res = sim.run(trace, job.duration_s)
    row: dict[str, Any] = {"key": job.key, "policy": job.fairness, "where": "simulator",
                           "duration_s": job.duration_s, "device_blocks": sim.device_blocks,
                           "peak_device_blocks": sim.peak_blocks,
                           "rotations": res.stats["rotations"],
                           "preemptions": res.stats["preemptions"],
                           "mean_batch_tokens": res.stats["mean_batch_tokens"],
                           "mean_iteration_s": res.stats["mean_iteration_s"],
                           "tenants": {}, "shares": res.shares,
                           "wall_s": time.perf_counter() - t0}
    for t in job.tenants:
        recs = [r for r in res.records if r.tenant == t.name]
        s = tenant_summary(recs, job.duration_s)
        s["rate"] = t.rate
        if job.windows:
            s["tok_s_in_windows"], s["work_tok_s_in_windows"] = tokens_in(recs, list(job.windows))
        if t.on_off_s is not None:  # the head of each on phase vs the on phases overall
            p = t.on_off_s
            head = [r for r in recs if r.arrival_s % (2 * p) < HEAD_S]
            s["ttft_head"] = compute_metrics(head, job.duration_s).ttft_attainment
            s["head_requests"] = len(head)
        row["tenants"][t.name] = s
    return row


# -- the scenarios ------------------------------------------------------------------------
def a_tenant(seed: int, name: str = "A", rate: float = RATE_A, **kw: Any) -> Tenant:
    return Tenant(name, rate, SLO_A, 1.0, seed=seed * 1000 + 1, **kw)


def b_tenant(seed: int, name: str = "B", rate: float = RATE_B, **kw: Any) -> Tenant:
    return Tenant(name, rate, SLO_B, SCALE_B, seed=seed * 1000 + 2, **kw)


def stage1_jobs(seed: int, dur: float, rates: tuple[float, float] = (RATE_A, RATE_B),
                full: bool = True) -> list[Job]:
    """A alone, A + B under each policy; in full, the on/off runs (B alone is their
    reference) and the blame runs."""
    a, b = a_tenant(seed, rate=rates[0]), b_tenant(seed, rate=rates[1])
    jobs = [Job(f"s{seed}/solo", (a,), "shares", dur)]
    jobs += [Job(f"s{seed}/flood/{p}", (a, b), p, dur) for p in POLICIES]
    if full:
        off = tuple(on_windows(PERIOD_S, dur, on=False))
        a_on = a_tenant(seed, rate=rates[0], on_off_s=PERIOD_S)
        jobs.append(Job(f"s{seed}/onoff/shares", (a_on, b), "shares", dur, windows=off))
        jobs.append(Job(f"s{seed}/b_solo", (b,), "shares", dur, windows=off))
        # Blame, the roles swapped: the interactive tenant is "B", the flooding one "A".
        sa, sb = a_tenant(seed, name="B", rate=rates[0]), b_tenant(seed, name="A",
                                                                    rate=rates[1])
        jobs.append(Job(f"s{seed}/swapped/global", (sb, sa), "global", dur))
        # Blame, A bursting at 2.5x its capacity, B a trickle (a tenth of its share).
        burst = (a_tenant(seed, rate=2.5 * CAP_A), b_tenant(seed, rate=CAP_B / 20))
        jobs.append(Job(f"s{seed}/burst/global", burst, "global", dur))
    return jobs


def stage2_jobs(seed: int, dur: float, pool: int) -> list[Job]:
    a, b = a_tenant(seed), b_tenant(seed)
    return [Job(f"s{seed}/rotation/{p}", (a, b), p, dur, device_blocks=pool)
            for p in ("shares", "vtc")]


def blame_share(row: dict[str, Any], victim: str, holder: str) -> float:
    b = row["tenants"][victim]["blame_s"]
    total = sum(b.values())
    return b.get(holder, 0.0) / total if total else math.nan


def summarize(rows: dict[str, dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The issue's per-run records: A alone vs A under flood, per policy."""
    solo = rows[f"s{seed}/solo"]["tenants"]["A"]
    out = []
    for key, row in rows.items():
        if not key.startswith(f"s{seed}/") or "A" not in row["tenants"]:
            continue
        kind = key.split("/")[1]
        if kind not in ("flood", "onoff", "rotation"):
            continue
        a = row["tenants"]["A"]
        rec = {"run": key, "seed": seed, "scenario": kind, "policy": row["policy"],
               "where": "simulator",
               "a_ttft_solo": solo["ttft"], "a_ttft_flood": a["ttft"],
               "a_tbt_solo": solo["tbt"], "a_tbt_flood": a["tbt"],
               "a_p99_ttft_solo_s": solo["p99_ttft_s"], "a_p99_ttft_flood_s": a["p99_ttft_s"],
               "a_p99_ttft_ratio": a["p99_ttft_s"] / solo["p99_ttft_s"],
               "b_ttft": row["tenants"]["B"]["ttft"], "b_tbt": row["tenants"]["B"]["tbt"],
               "shares": row["shares"], "device_blocks": row["device_blocks"],
               "peak_device_blocks": row["peak_device_blocks"],
               "rotations": row["rotations"], "preemptions": row["preemptions"]}
        if kind in ("flood", "rotation"):
            rec["a_blame_share_b"] = blame_share(row, "A", "B")
        if kind == "onoff" and "tok_s_in_windows" in row["tenants"]["B"]:  # off windows
            ref = rows[f"s{seed}/b_solo"]["tenants"]["B"]["tok_s_in_windows"]
            rec["b_tok_s_off_phases"] = row["tenants"]["B"]["tok_s_in_windows"]
            rec["b_solo_tok_s_off_phases"] = ref
            rec["b_work_conservation"] = rec["b_tok_s_off_phases"] / ref
            # A's requests seated in an on phase still decode in the off phase: the device's
            # work (every tenant's prompt + output tokens) against B alone's in the windows.
            work = sum(t["work_tok_s_in_windows"] for t in row["tenants"].values())
            rec["device_work_conservation"] = (
                work / rows[f"s{seed}/b_solo"]["tenants"]["B"]["work_tok_s_in_windows"])
            rec["a_tok_s_off_phases"] = a["tok_s_in_windows"]
            rec["a_ttft_head"] = a["ttft_head"]
        out.append(rec)
    return out


def checks(runs: list[dict[str, Any]], rows: dict[str, dict[str, Any]]) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []
    for r in runs:
        tag = f"{r['run']}"
        if r["scenario"] == "flood" and r["policy"] == "shares":
            for m in ("ttft", "tbt"):
                d = 100 * (r[f"a_{m}_solo"] - r[f"a_{m}_flood"])
                out.append((f"{tag}: A {m.upper()} within {ATTAIN_POINTS:g} points of alone",
                            d <= ATTAIN_POINTS, f"{-d:+.1f} points"))
            out.append((f"{tag}: A p99 TTFT <= {P99_RATIO}x alone",
                        r["a_p99_ttft_ratio"] <= P99_RATIO, f"{r['a_p99_ttft_ratio']:.2f}x"))
        if r["scenario"] == "flood" and r["policy"] == "global":
            d = 100 * (r["a_ttft_solo"] - r["a_ttft_flood"])
            out.append((f"{tag}: A loses >= {GLOBAL_LOSS:g} TTFT points (load hard enough)",
                        d >= GLOBAL_LOSS, f"{-d:+.1f} points"))
        if r["scenario"] == "onoff" and "b_work_conservation" in r:
            w = r["b_work_conservation"]
            out.append((f"{tag}: B work conservation >= {WORK_CONSERVATION}",
                        w >= WORK_CONSERVATION, f"{w:.3f}"))
            d = r["device_work_conservation"]
            out.append((f"{tag}: the device's work in A's off phases >= {WORK_CONSERVATION} "
                        "of B alone's (diagnostic)", d >= WORK_CONSERVATION, f"{d:.3f}"))
    for key, row in rows.items():
        kind = key.split("/")[1]
        if kind == "flood" and row["policy"] == "global":
            s = blame_share(row, "A", "B")
            out.append((f"{key}: A's blame names B (> 50 %)", s > 0.5, f"{100 * s:.0f} %"))
        if kind == "swapped":
            s = blame_share(row, "B", "A")
            out.append((f"{key}: B's blame names A (> 50 %)", s > 0.5, f"{100 * s:.0f} %"))
        if kind == "burst":
            s = blame_share(row, "A", "A")
            out.append((f"{key}: A's blame names A (> 50 %)", s > 0.5, f"{100 * s:.0f} %"))
    return out


# -- the capacity sweep -------------------------------------------------------------------
def sweep_jobs(dur: float) -> list[Job]:
    jobs = [Job(f"sweep/A/{r:g}", (a_tenant(0, rate=r),), "shares", dur) for r in SWEEP["A"]]
    jobs += [Job(f"sweep/B/{r:g}", (b_tenant(0, rate=r),), "shares", dur) for r in SWEEP["B"]]
    return jobs


def pct(x: float) -> str:
    return f"{100 * x:.1f}" if x == x else "-"


def print_tables(rows: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    print(f"\nTenant rows ({CELL}; A {RATE_A:g} req/s SLO {SLO_A.ttft_s:g} s/"
          f"{SLO_A.tbt_s * 1000:.0f} ms; B {RATE_B:g} req/s, lengths x{SCALE_B:g}, SLO "
          f"{SLO_B.ttft_s:g} s/{SLO_B.tbt_s * 1000:.0f} ms)")
    print("| run | tenant | reqs | TTFT % | TBT % | p50 TTFT s | p99 TTFT s | tok/s | "
          "tokens share | block-s share | blame s (holder) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, row in rows.items():
        for name, t in row["tenants"].items():
            sh = row["shares"].get(name, {})
            bl = ", ".join(f"{k} {v:.0f}" for k, v in sorted(t["blame_s"].items())) or "-"
            print(f"| {key} | {name} | {t['requests']} | {pct(t['ttft'])} | {pct(t['tbt'])} | "
                  f"{t['p50_ttft_s']:.2f} | {t['p99_ttft_s']:.2f} | "
                  f"{t['throughput_tok_s']:.0f} | {pct(sh.get('tokens', math.nan))} | "
                  f"{pct(sh.get('block_seconds', math.nan))} | {bl} |")
    print("\n| run | policy | A TTFT alone → with B | A TBT alone → with B | A p99 TTFT ratio | "
          "B work conservation (device) | A TTFT first 5 s of on |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        wc = (f"{r['b_work_conservation']:.3f} (device {r['device_work_conservation']:.3f})"
              if "b_work_conservation" in r else "-")
        head = pct(r["a_ttft_head"]) if "a_ttft_head" in r else "-"
        print(f"| {r['run']} | {r['policy']} | {pct(r['a_ttft_solo'])} → {pct(r['a_ttft_flood'])} "
              f"| {pct(r['a_tbt_solo'])} → {pct(r['a_tbt_flood'])} | "
              f"{r['a_p99_ttft_ratio']:.2f} | {wc} | {head} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", default="0", help="workload seeds, comma separated")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--out", default=".experiments/tenant_shares", help="output folder")
    p.add_argument("--jobs", type=int, default=2, help="simulations in parallel")
    p.add_argument("--check", action="store_true",
                   help="print which thresholds hold; exit 1 if one does not")
    p.add_argument("--sweep", action="store_true",
                   help="only the capacity sweep (each tenant alone, 30 s per rate)")


def run_jobs(jobs: list[Job], n: int) -> dict[str, dict[str, Any]]:
    """The jobs' rows: in this process for n <= 1, else in n spawned processes (not
    forked: a fork of a process whose OpenMP pool is up, torch's, can spin forever in the
    child; under pytest-xdist it did, for minutes)."""
    if n <= 1:
        return {r["key"]: r for r in map(run_job, jobs)}
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        return {r["key"]: r for r in pool.map(run_job, jobs)}


def study(seeds: list[int], duration: float, jobs: int,
          rates: tuple[float, float] = (RATE_A, RATE_B), full: bool = True) -> dict[str, Any]:
    """Every scenario's runs and their records (`full=False`: A alone and the floods)."""
    rows = run_jobs([j for s in seeds for j in stage1_jobs(s, duration, rates, full)], jobs)
    if full:
        # The working set: the flood's peak device blocks in use with the cell's pool.
        pools = {s: max(1, rows[f"s{s}/flood/shares"]["peak_device_blocks"] // 4)
                 for s in seeds}
        rows.update(run_jobs([j for s in seeds for j in stage2_jobs(s, duration, pools[s])],
                             jobs))
    runs = [r for s in seeds for r in summarize(rows, s)]
    return {"cell": CELL, "rates": {"A": rates[0], "B": rates[1]},
            "capacity_req_s": {"A": CAP_A, "B": CAP_B}, "runs": runs, "rows": rows,
            "checks": [{"check": c, "holds": ok, "value": v}
                       for c, ok, v in checks(runs, rows)]}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        rows = run_jobs(sweep_jobs(30.0), args.jobs)
        print("| tenant | req/s | TTFT % | TBT % | p99 TTFT s | tok/s |\n|---|---|---|---|---|---|")
        for row in rows.values():
            for name, t in row["tenants"].items():
                print(f"| {name} | {t['rate']:g} | {pct(t['ttft'])} | {pct(t['tbt'])} | "
                      f"{t['p99_ttft_s']:.2f} | {t['throughput_tok_s']:.0f} |")
        (out / "sweep.json").write_text(json.dumps(rows, indent=1))
        return 0
    seeds = [int(s) for s in str(args.seeds).split(",")]
    results = study(seeds, args.duration, args.jobs)
    results["command"] = "python -m experiments tenant-shares " + " ".join(sys.argv[2:])
    runs, rows = results["runs"], results["rows"]
    print_tables(rows, runs)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'results.json'}")
    if args.check:
        bad = 0
        for c, ok, v in checks(runs, rows):
            print(f"{'HOLDS' if ok else 'FAILS'}  {c}: {v}")
            bad += not ok
        return 1 if bad else 0
    return 0
