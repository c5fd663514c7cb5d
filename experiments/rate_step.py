"""Rate step in the simulator: which LVF rule's best value moves with load, and the
adaptive residency against each fixed one.

A three-phase trace on the must-show cell `mixed_gh200_artifact` (GH200, Qwen2.5-32B,
the artifact's flags, ShareGPT-like lengths, mixed SLO classes): phase 1 at `--base`
req/s, phase 2 at `--peak`, phase 3 back at `--base`, each `--phase-s` seconds, built by
concatenating `build_trace` segments (gamma arrivals, the cell's length distributions
and classes). Every request is scored by the phase its arrival falls in, with the code's
own `compute_metrics`; while the run goes, the scheduler is sampled every `--sample-s`
simulated seconds (queue lengths, iteration time, parked requests' lateness).

    python -m experiments rate-step --params fixed_res --seeds 0,1,2 --base 14 --peak 28

Writes `<out>/<label>.seed<N>.json` per run, `<out>/summary.md` and `<out>/results.json`
(per variant and phase, the mean over the seeds; with `fixed_res`, the adaptation check:
in each phase, adaptive >= the default fixed residency and within 2 points of the best
fixed one, on the mean joint attainment).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from experiments.must_show import CELLS
from superinfer.sim import cli as sim_cli
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.slo_metrics import compute_metrics
from superinfer.workload import TraceRequest, build_trace

CELL = "mixed_gh200_artifact"

# parameter -> (variant key, values); the first-listed default is LVF's (SimConfig's).
SWEEPS: dict[str, tuple[str, list[str]]] = {
    "memory_margin": ("memory_margin", ["0", "1", "3", "6", "12"]),
    "alpha": ("alpha", ["0.5", "1", "2", "4"]),
    "tbt_budget": ("tbt_budget", ["0.6", "0.75", "0.9", "1.0"]),
    "lazy_margin": ("lazy_margin", ["0", "0.25", "0.5", "1"]),
    "min_res": ("min_res", ["0", "8", "32", "128"]),
    "xfer": ("xfer", ["auto", "none", "200", "50"]),
    "room": ("room", ["0", "0.5", "1"]),
    # LVF's residency fixed (the default: 32) and adapted (policy/residency.py, off).
    "fixed_res": ("min_res", ["0", "8", "32", "128"]),
    "adaptive": ("adapt", ["on"]),
}
# The value of each that equals the default run (so it is run once, as "default").
DEFAULTS = {"memory_margin": "6", "alpha": "1", "tbt_budget": "0.9", "lazy_margin": "0.25",
            "min_res": "32", "xfer": "auto", "room": "0.5", "fixed_res": "32", "adaptive": "off"}


def cell_args(extra: list[str] | None = None) -> argparse.Namespace:
    """The cell's `superinfer sim` arguments, parsed by the sim's own parser."""
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    return p.parse_args([*CELLS[CELL][1], *(extra or [])])


def step_trace(args: argparse.Namespace, phases: list[tuple[float, float]],
               seed: int) -> list[TraceRequest]:
    """Concatenated segments: (rate, seconds) each, own seeded streams per segment."""
    out: list[TraceRequest] = []
    t0 = 0.0
    for k, (rate, dur) in enumerate(phases):
        spec = dataclasses.replace(sim_cli.workload_spec(args, rate), duration_s=dur,
                                   num_prompts=None, seed=seed * 1000 + k)
        for r in build_trace(spec):
            out.append(dataclasses.replace(r, index=len(out), arrival_s=t0 + r.arrival_s))
        t0 += dur
    return out


class ProbeSimulator(Simulator):
    """The simulator with the scheduler sampled every `sample_s` simulated seconds."""

    def __init__(self, *a: Any, sample_s: float = 1.0, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.sample_s = sample_s
        self.samples: list[dict[str, float]] = []

    def make_scheduler(self, clock: Callable[[], float]) -> Any:
        sched = super().make_scheduler(clock)
        inner = sched.schedule
        state = {"next": 0.0, "t": 0.0, "it": 0}
        samples = self.samples
        step = self.sample_s

        def schedule() -> Any:
            now = clock()
            if now >= state["next"]:
                it = sched.stats.iterations
                d_it = it - state["it"]
                rot = sched.rotary.list()
                started = [r for r in rot if r.token_times]
                stalls = [now - r.token_times[-1] for r in started]
                late = [s - r.slo.tbt_s for s, r in zip(stalls, started)]
                over = [x for x in late if x > 0]
                wait = sched.waiting.list()
                ages = [(now - r.arrival_time) / r.slo.ttft_s for r in wait]
                samples.append({
                    "t": now,
                    "waiting": len(wait),
                    "running": len(sched.running),
                    "rotary": len(rot),
                    "rotary_started": len(started),
                    "iter_s": (now - state["t"]) / d_it if d_it else math.nan,
                    "parked_over_tbt": len(over),
                    "parked_mean_stall_s": sum(stalls) / len(stalls) if stalls else 0.0,
                    "parked_max_stall_s": max(stalls, default=0.0),
                    "waiting_past_ttft": sum(a > 1.0 for a in ages),
                    "waiting_max_age_ttft": max(ages, default=0.0),
                })
                state.update(next=now + step, t=now, it=it)
            return inner()

        sched.schedule = schedule  # type: ignore[method-assign]
        return sched


def phase_metrics(records: list[Any], lo: float, hi: float) -> dict[str, Any]:
    sub = [r for r in records if lo <= r.arrival_s < hi]
    m = compute_metrics(sub, hi - lo)
    tpot_miss = sum(1 for r in sub if (t := r.tpot_s()) is not None and t > r.tbt_slo_s)
    out: dict[str, Any] = {
        "requests": m.requests,
        "ttft": m.ttft_attainment, "tbt": m.tbt_attainment, "tpot": m.tpot_attainment,
        "joint": m.good_requests / m.requests if m.requests else math.nan,  # TTFT & TPOT
        "goodput_rps": m.good_requests / (hi - lo),  # good requests per s of the phase
        "goodput_every_gap_rps": m.goodput_every_gap_rps,
        "ttft_missed": m.ttft_missed, "tbt_missed_gaps": m.tbt_missed,
        "tpot_missed": tpot_miss, "unfinished": sum(not r.finished for r in sub),
        "stall_s": m.stall_s, "max_gap_s": m.max_gap_s, "p99_ttft_s": m.p99_ttft_s,
        "rotations": m.rotations,
        "per_class": {k: {x: v[x] for x in ("requests", "ttft_attainment", "tbt_attainment",
                                             "tpot_attainment")}
                      for k, v in m.per_class.items()},
    }
    for k in m.per_class:
        good = [r for r in sub if r.slo_class == k]
        out["per_class"][k]["joint"] = (sum(r.meets_slo_vllm() for r in good) / len(good)
                                        if good else math.nan)
    return out


def window_obs(samples: list[dict[str, float]], lo: float, hi: float) -> dict[str, float]:
    s = [x for x in samples if lo <= x["t"] < hi]
    if not s:
        return {}
    keys = [k for k in s[0] if k != "t"]
    out = {}
    for k in keys:
        vals = [x[k] for x in s if not math.isnan(x[k])]
        out[k] = sum(vals) / len(vals) if vals else math.nan
    out["rotary_end"] = s[-1]["rotary"]
    out["waiting_end"] = s[-1]["waiting"]
    return out


def run_one(task: tuple[str, str, int, list[tuple[float, float]], float]) -> dict[str, Any]:
    label, spec, seed, phases, sample_s = task
    args = cell_args()
    hw, model = load_hardware(args.hardware), load_model(args.model)
    cfg: SimConfig = sim_cli.build_config(args)
    variant = PolicyVariant.parse(spec)
    trace = step_trace(args, phases, seed)
    sim = ProbeSimulator(hw, model, variant.policy, variant.apply(cfg), label=label,
                         sample_s=sample_s)
    w0 = time.perf_counter()
    res = sim.run(trace, sum(d for _, d in phases))
    wall = time.perf_counter() - w0
    bounds, t0 = [], 0.0
    for _, d in phases:
        bounds.append((t0, t0 + d))
        t0 += d
    per_phase = [phase_metrics(res.records, lo, hi) for lo, hi in bounds]
    obs = [window_obs(sim.samples, lo, hi) for lo, hi in bounds]
    obs.append(window_obs(sim.samples, t0, math.inf))  # the drain after the last arrival
    keep = ("sim_time_s", "iterations", "rotations", "preemptions", "growth_preemptions",
            "parked_preemptions", "swap_in_blocks", "swap_out_blocks", "unfinished",
            "mean_iteration_s", "max_running")
    return {"label": label, "spec": spec, "seed": seed, "phases": phases, "wall_s": wall,
            "requests": len(trace), "per_phase": per_phase, "observables": obs,
            "stats": {k: res.stats.get(k) for k in keep}, "samples": sim.samples}


def variants(params: list[str]) -> list[tuple[str, str]]:
    """(label, policy spec): the default once, then each non-default value."""
    out = [("default", "lvf")]
    for p in params:
        key, vals = SWEEPS[p]
        out += [(f"{p}={v}", f"lvf:{key}={v}") for v in vals if v != DEFAULTS[p]]
    return out


def pct(x: float) -> str:
    return "  -  " if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:5.1f}"


def _label(param: str, value: str) -> str:
    """A run's label: "default" for the default value, else PARAM=VALUE."""
    return "default" if value == DEFAULTS[param] else f"{param}={value}"


def _runs(by: dict[tuple[str, int], dict[str, Any]], param: str, vals: list[str],
          seeds: list[int]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(value, seed, run) of `param`'s runs that exist, value by value."""
    for v in vals:
        for s in seeds:
            r = by.get((_label(param, v), s))
            if r is not None:
                yield v, s, r


def summarize(results: list[dict[str, Any]], params: list[str], seeds: list[int]) -> str:
    by = {(r["label"], r["seed"]): r for r in results}
    lines = []
    first = results[0]
    lines.append(f"phases (req/s x s): {first['phases']}; requests per run: "
                 + ", ".join(f"seed {s}: {by[('default', s)]['requests']}" for s in seeds
                             if ('default', s) in by))
    lines.append("cells: TTFT/TBT/TPOT/joint % (joint: TTFT and TPOT, vLLM's goodput test); "
                 "gp: good req/s of the phase; I: interactive class joint %")
    for p in params:
        key, vals = SWEEPS[p]
        lines += ["", f"## {p}", "",
                  "| value | seed | P1 (1x) | P2 (2x) | P3 (1x) | gp P1/P2/P3 | I joint P1/P2/P3 |"
                  " wall s |", "|---|---|---|---|---|---|---|---|"]
        for v, s, r in _runs(by, p, vals, seeds):
            ph = r["per_phase"]
            cells = [" / ".join(pct(x[k]).strip() for k in ("ttft", "tbt", "tpot", "joint"))
                     for x in ph]
            gp = "/".join(f"{x['goodput_rps']:.2f}" for x in ph)
            ij = "/".join(pct(x["per_class"].get("interactive", {}).get("joint")).strip()
                          for x in ph)
            lines.append(f"| {v}{' (def)' if v == DEFAULTS[p] else ''} | {s} | "
                         + " | ".join(cells) + f" | {gp} | {ij} | {r['wall_s']:.0f} |")
        lines += ["", "misses and observables (per phase P1/P2/P3): TTFT-missed requests, "
                  "TPOT-missed requests, TBT-missed gaps; mean iteration ms, waiting, parked "
                  "(rotary), parked requests' mean stall s (now - last token); rotations", "",
                  "| value | seed | TTFT miss | TPOT miss | TBT gaps miss | iter ms | waiting "
                  "| parked | parked stall s | rotations |", "|---|---|---|---|---|---|---|---|---|---|"]
        for v, s, r in _runs(by, p, vals, seeds):
            ph, ob = r["per_phase"], r["observables"]

            def j(xs: list[Any], k: str, f: str = "{:.0f}") -> str:
                return "/".join(f.format(x.get(k, math.nan)) for x in xs)

            lines.append(
                f"| {v} | {s} | {j(ph, 'ttft_missed')} | {j(ph, 'tpot_missed')} | "
                f"{j(ph, 'tbt_missed_gaps')} | "
                + "/".join(f"{1000 * x.get('iter_s', math.nan):.1f}" for x in ob[:3])
                + f" | {j(ob[:3], 'waiting')} | {j(ob[:3], 'rotary')} | "
                f"{j(ob[:3], 'parked_mean_stall_s', '{:.1f}')} | {j(ph, 'rotations')} |")
        for s in seeds:
            best = []
            for i in range(3):
                scored = []
                for v in vals:
                    run_ = by.get((_label(p, v), s))
                    if run_:
                        scored.append((100 * run_["per_phase"][i]["joint"], v))
                if scored:
                    top = max(g for g, _ in scored)
                    best.append(f"P{i + 1}: " + ",".join(v for g, v in scored if g >= top - 0.5)
                                + f" ({top:.1f})")
            lines.append(f"\nbest joint (ties within 0.5 points), seed {s}: " + "; ".join(best))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=".experiments/rate_step/runs")
    p.add_argument("--seeds", default="0")
    p.add_argument("--params", default=",".join(SWEEPS))
    p.add_argument("--base", type=float, default=17.0, help="1x rate, req/s")
    p.add_argument("--peak", type=float, default=34.0, help="2x rate, req/s")
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    p.add_argument("--summary-only", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    params = a.params.split(",")
    phases = [(a.base, a.phase_s), (a.peak, a.phase_s), (a.base, a.phase_s)]
    todo = variants(params)
    if a.only:
        keep = set(a.only.split(","))
        todo = [t for t in todo if t[0] in keep]
    tasks = [(lab, spec, s, phases, a.sample_s) for s in seeds for lab, spec in todo
             if not (out / f"{lab}.seed{s}.json").exists()]
    if not a.summary_only and tasks:
        t0 = time.perf_counter()
        import multiprocessing as mp

        with mp.get_context("fork").Pool(a.jobs) as pool:
            for r in pool.imap_unordered(run_one, tasks):
                (out / f"{r['label']}.seed{r['seed']}.json").write_text(json.dumps(r))
                ph = r["per_phase"]
                print(f"{r['label']:>20} seed {r['seed']}: {r['wall_s']:5.1f} s  joint "
                      + " / ".join(pct(x["joint"]) for x in ph), flush=True)
        print(f"{len(tasks)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    results = [json.loads(f.read_text()) for f in sorted(out.glob("*.seed*.json"))]
    results = [r for r in results if r["phases"] == [list(x) for x in phases]]
    text = summarize(results, params, seeds)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    summary = mean_rows(results, seeds)
    check = adaptation_check(summary) if {"fixed_res", "adaptive"} <= set(params) else None
    if check is not None:
        print("\nadaptive vs fixed residency, mean joint % over the seeds, per phase:")
        for c in check["phases"]:
            print(f"  P{c['phase']}: adaptive {c['adaptive']:.1f}, fixed 32 {c['default']:.1f}, "
                  f"best fixed {c['best']:.1f} ({c['best_label']}): "
                  f"{'holds' if c['holds'] else 'FAILS'}")
    (out / "results.json").write_text(json.dumps(
        {"phases": phases, "seeds": seeds, "rows": summary, "adaptation_check": check},
        indent=1) + "\n")
    return 0


def mean_rows(results: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Per label and phase: the mean over `seeds` of TTFT, TBT, TPOT and joint attainment."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["seed"] in seeds:
            by.setdefault(r["label"], []).append(r)
    rows = []
    for label, runs in sorted(by.items()):
        for k in range(len(runs[0]["per_phase"])):
            ph = [r["per_phase"][k] for r in runs]
            rows.append({"label": label, "phase": k + 1, "seeds": len(runs), **{
                m: sum(x[m] for x in ph) / len(ph) for m in ("ttft", "tbt", "tpot", "joint")},
                "joint_per_seed": [x["joint"] for x in ph]})
    return rows


def adaptation_check(rows: list[dict[str, Any]], points: float = 2.0) -> dict[str, Any] | None:
    """In each phase: the adaptive residency >= the default (fixed 32) and within `points`
    of the best fixed residency, on the mean joint attainment."""
    phases: list[dict[str, Any]] = []
    for k in sorted({r["phase"] for r in rows}):
        at = {r["label"]: 100.0 * r["joint"] for r in rows if r["phase"] == k}
        fixed = {lab: v for lab, v in at.items() if lab.startswith("fixed_res=")}
        if "adaptive=on" not in at or "default" not in at:
            return None
        fixed["fixed_res=32"] = at["default"]
        best_label = max(fixed, key=lambda lab: fixed[lab])
        a, d, b = at["adaptive=on"], fixed["fixed_res=32"], fixed[best_label]
        phases.append({"phase": k, "adaptive": a, "default": d, "best": b,
                       "best_label": best_label,
                       "holds": a >= d - 1e-9 and a >= b - points})
    return {"points": points, "phases": phases, "holds": all(p["holds"] for p in phases)}


if __name__ == "__main__":
    raise SystemExit(main())
