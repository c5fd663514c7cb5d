"""Rate step on the real stack: LVF's adaptive residency against fixed ones, per phase.

For each variant of LVF's rules (`--variants`; default `adaptive`: adapt_residency=on,
`fixed32`: the engine's own rules (a fixed residency of 32), `fixed0`:
min_residency=0) it starts the real four-service stack as `superinfer
serve` does (worker, kvmem, scheduler, gateway: separate processes under serve's
supervisor), its scheduler child run through `python -m experiments.rules_scheduler
--rules RULES` (the only place the rules are set: no server flag, environment variable or
file carries them), serves `--warmup` requests, then drives a rate step with `superinfer
bench serve` as a separate client process: phase 1 at `--base` req/s, phase 2 at
`--peak` (default 2x base), phase 3 at `--base` again, each `--phase-s` seconds, gamma
arrivals with a fixed seed (the same trace for every variant; checked), and stops the stack.

Workload: the real-stack cells of docs/results/rotasched/ ("Real stack at the engine's
defaults", `make reproduce-rotasched-real`): the bundled model, `--policy lvf
--device-blocks 64 --host-blocks 4096 --max-num-seqs 32`, SLOs 10 s TTFT / 0.3 s TBT,
bench serve's `--dataset sharegpt --max-prompt-len 384 --max-output-len 64 --endpoint chat
--no-ignore-eos --max-tokens 512`, 8 warm-up requests; saturation there ~0.57 req/s, so
base 0.57 and peak 1.14.

`superinfer bench serve` builds its trace from one rate; it takes no prebuilt trace or
trace file. The client process here (`python -m experiments.rate_step_real --step-client
PHASES <bench serve argv>`) runs bench serve's own `run` with its `build_trace` replaced,
in that process only, by one that concatenates a segment per phase (bench serve's spec
with the phase's rate and length and seed `seed * 1000 + k`, as the simulator's rate-step
probe builds them), arrivals offset and requests renumbered; the rest (prompts, streaming,
timing, JSON with every request) is bench serve's.

Scoring: every request by the phase its (trace) arrival falls in, with
`superinfer.slo_metrics.compute_metrics` over records rebuilt from bench serve's
per-request details (arrival = when it was sent, as bench serve counts it): TTFT
attainment, per-gap TBT attainment, TPOT attainment, joint = TTFT and TPOT met (vLLM's
goodput test, of the phase's requests) and goodput = those good requests per second of the
phase.

    python -m experiments rate-step-real --out .experiments/rate_step_real

writes `<out>/results.json` (command, config, machine, per variant and phase: ttft, tbt,
tpot, joint, goodput, requests, ...), `<out>/table.md`, `<out>/<variant>.json` (bench
serve's output) and `<out>/.run-<variant>/` (the stack's logs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# name -> rules (experiments/rules_scheduler.py's --rules text; '' is the engine's own).
PRESETS: dict[str, str] = {
    "adaptive": "adapt_residency=on",
    "fixed32": "",
    "fixed0": "min_residency=0",
}
VARIANTS = "adaptive,fixed32,fixed0"
# The bench serve workload of the real-stack cells (experiments/reproduce.mk,
# reproduce-rotasched-real, through experiments/policies.py's defaults).
CELL_BENCH_ARGS = "--endpoint chat --no-ignore-eos --max-tokens 512"


def add_arguments(p: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{k}: {v or 'no overrides'}" for k, v in PRESETS.items())
    p.add_argument("--variants", default=VARIANTS,
                   help=f"comma-separated: presets ({presets}) or labels given with --variant")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=RULES",
                   help="define a variant, e.g. 'fixed8=adapt_residency=off,min_residency=8' "
                        "(repeatable; name it in --variants, or it is appended)")
    p.add_argument("--base", type=float, default=0.57, help="phases 1 and 3, req/s")
    p.add_argument("--peak", type=float, default=None, help="phase 2, req/s (default 2 x base)")
    p.add_argument("--phase-s", type=float, default=120.0, help="seconds of arrivals per phase")
    p.add_argument("--seed", type=int, default=11,
                   help="the trace's seed (phase k's segment: seed * 1000 + k)")
    p.add_argument("--warmup", type=int, default=8, metavar="N",
                   help="requests each fresh stack serves (all at once, seed + 1) before the "
                        "step: a cold stack serves its first ~40 s slower (0: none)")
    p.add_argument("--ttft-slo", type=float, default=10.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=0.3, help="seconds")
    p.add_argument("--device-blocks", type=int, default=64)
    p.add_argument("--host-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--max-prompt-len", type=int, default=384)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--serve-args", default="", help="more flags for `superinfer serve`")
    p.add_argument("--bench-args", default=CELL_BENCH_ARGS,
                   help=f"more flags for bench serve (default: the cells' '{CELL_BENCH_ARGS}')")
    p.add_argument("--out", default=".experiments/rate_step_real", help="output directory")
    p.add_argument("--startup-timeout", type=float, default=300.0)


# -- variants and phases ----------------------------------------------------------------------
def resolve_variants(names: str, defined: list[str]) -> dict[str, str]:
    """{label: canonical rules text}, in run order; every rules text checked now."""
    from experiments.rules_scheduler import format_rules, parse_rules

    table = dict(PRESETS)
    extra = []
    for spec in defined:
        label, sep, rules = spec.partition("=")
        label = label.strip()
        if not sep or not label:
            raise ValueError(f"--variant {spec!r}: expected LABEL=RULES, e.g. "
                             "'fixed8=adapt_residency=off,min_residency=8'")
        if not all(c.isalnum() or c in "-_." for c in label):
            raise ValueError(f"--variant {spec!r}: a label is letters, digits, '-', '_' and "
                             "'.' only (it names the pass's files)")
        table[label] = rules
        extra.append(label)
    order = [n.strip() for n in names.split(",") if n.strip()]
    order += [x for x in extra if x not in order]
    out: dict[str, str] = {}
    for name in order:
        if name not in table:
            raise ValueError(f"unknown variant {name!r}: a preset ({', '.join(PRESETS)}) or a "
                             "label defined with --variant LABEL=RULES")
        if name in out:
            raise ValueError(f"variant {name!r} is named twice")
        try:
            out[name] = format_rules(parse_rules(table[name]))
        except ValueError as e:
            raise ValueError(f"variant {name!r}: {e}") from None
    if not out:
        raise ValueError("no variants to run")
    return out


def phases_of(base: float, peak: float, phase_s: float) -> list[tuple[float, float]]:
    return [(base, phase_s), (peak, phase_s), (base, phase_s)]


def format_phases(phases: list[tuple[float, float]]) -> str:
    return ",".join(f"{r:g}:{d:g}" for r, d in phases)


def parse_phases(text: str) -> list[tuple[float, float]]:
    """'RATE:SECONDS,...' -> [(rate, seconds)]."""
    out = []
    for part in text.split(","):
        rate, sep, dur = part.partition(":")
        try:
            r, d = float(rate), float(dur)
        except ValueError:
            raise ValueError(f"phase {part!r}: expected RATE:SECONDS") from None
        if not sep or not (r > 0 and math.isfinite(r) and d > 0 and math.isfinite(d)):
            raise ValueError(f"phase {part!r}: expected RATE:SECONDS, both positive and finite")
        out.append((r, d))
    return out


def bounds_of(phases: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, t0 = [], 0.0
    for _, d in phases:
        out.append((t0, t0 + d))
        t0 += d
    return out


def step_trace(spec: Any, phases: list[tuple[float, float]], build: Any,
               tokenizer: Any = None) -> list[Any]:
    """One segment per phase from `spec` (bench serve's, its rate and length replaced),
    each with its own seed, arrivals offset by the phases before it, renumbered."""
    out: list[Any] = []
    for k, ((rate, dur), (lo, _)) in enumerate(zip(phases, bounds_of(phases))):
        seg = dataclasses.replace(spec, rps=rate, duration_s=dur, num_prompts=None,
                                  seed=spec.seed * 1000 + k)
        for r in build(seg, tokenizer):
            out.append(dataclasses.replace(r, index=len(out), arrival_s=lo + r.arrival_s))
    return out


# -- scoring ----------------------------------------------------------------------------------
def records_of(bench: dict[str, Any]) -> list[tuple[float, Any]]:
    """(trace arrival, RequestRecord) per request of a bench serve JSON's one pass: the
    record as bench serve's own (arrival = sent, token times, finished = no error)."""
    from superinfer.slo_metrics import RequestRecord
    from superinfer.workload import parse_slo_classes

    cfg = bench["config"]
    classes = {c.name: c for c in parse_slo_classes(cfg.get("slo_classes"))}
    (row,) = bench["results"]
    out = []
    for d in row["per_request"]:
        slo = classes.get(d.get("slo_class") or "")
        sent = d["sent_s"]
        out.append((d["scheduled_s"], RequestRecord(
            request_id=f"r{d['index']}", arrival_s=sent,
            token_times=[sent + t for t in d["token_times_s"]],
            ttft_slo_s=slo.ttft_s if slo else cfg["ttft_slo_s"],
            tbt_slo_s=slo.tbt_s if slo else cfg["tbt_slo_s"],
            prompt_tokens=d.get("prompt_tokens") or 0,
            finished=d.get("error") is None, slo_class=d.get("slo_class"))))
    return out


def phase_scores(records: list[tuple[float, Any]], lo: float, hi: float) -> dict[str, Any]:
    """The requests whose trace arrival is in [lo, hi), scored by compute_metrics."""
    from superinfer.slo_metrics import compute_metrics

    sub = [rec for at, rec in records if lo <= at < hi]
    m = compute_metrics(sub, hi - lo)
    n = m.requests

    def num(v: float) -> float | None:
        return None if isinstance(v, float) and math.isnan(v) else v

    return {
        "requests": n,
        "ttft": num(m.ttft_attainment), "tbt": num(m.tbt_attainment),
        "tpot": num(m.tpot_attainment),
        "joint": m.good_requests / n if n else None,  # TTFT and TPOT: vLLM's goodput test
        "goodput": m.good_requests / (hi - lo),  # good requests per second of the phase
        "good_requests": m.good_requests,
        "goodput_every_gap": num(m.goodput_every_gap_rps),
        "completed": m.completed, "failed": n - m.completed,
        "ttft_missed": m.ttft_missed, "tbt_missed_gaps": m.tbt_missed,
        "tpot_missed": sum(1 for r in sub if (t := r.tpot_s()) is not None and t > r.tbt_slo_s),
        "p50_ttft_s": num(m.p50_ttft_s), "p99_ttft_s": num(m.p99_ttft_s),
        "p99_tbt_s": num(m.p99_tbt_s), "max_gap_s": num(m.max_gap_s), "stall_s": m.stall_s,
        "output_tokens": m.output_tokens,
    }


def score(bench: dict[str, Any], phases: list[tuple[float, float]]) -> list[dict[str, Any]]:
    recs = records_of(bench)
    out = []
    for k, ((rate, _), (lo, hi)) in enumerate(zip(phases, bounds_of(phases))):
        out.append({"phase": k + 1, "rate": rate, "start_s": lo, "end_s": hi,
                    **phase_scores(recs, lo, hi)})
    return out


def trace_digest(bench: dict[str, Any]) -> str:
    """What the trace was (arrival, lengths of every request), hashed: equal across variants."""
    (row,) = bench["results"]
    key = [(d["index"], round(d["scheduled_s"], 9), d["trace_prompt_len"], d["trace_output_len"],
            d.get("slo_class")) for d in row["per_request"]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def format_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """variant x phase: TTFT / TBT / TPOT / joint %, goodput, requests."""
    from superinfer.bench.report import table

    rows = []
    for variant, per_phase in results.items():
        for ph in per_phase:
            rows.append([variant, f"P{ph['phase']} @ {ph['rate']:g}", ph["requests"],
                         _pct(ph["ttft"]), _pct(ph["tbt"]), _pct(ph["tpot"]), _pct(ph["joint"]),
                         f"{ph['goodput']:.3f}", ph["failed"]])
    return table(["variant", "phase (req/s)", "requests", "TTFT%", "TBT%", "TPOT%", "joint%",
                  "goodput", "failed"], rows)


# -- the stack and the client -----------------------------------------------------------------
def serve_command(rules: str, flags: list[str]) -> list[str]:
    """`superinfer serve FLAGS` with its scheduler run through rules_scheduler."""
    return [sys.executable, "-m", "experiments.rules_scheduler", "--rules", rules, "--serve",
            *flags]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """`serve`'s engine flags, as experiments.policies gives them to LVF's passes."""
    from experiments.policies import engine_argv

    # Its `variants` are policy variants (serve flags); these are rules, not its business.
    return engine_argv("lvf", {**vars(args), "variants": {}})


def _stack_class() -> Any:
    from experiments.policies import Stack

    class RulesStack(Stack):
        """experiments.policies' Stack (wait for /health, SIGTERM and wait to stop), started
        through rules_scheduler's `--serve` instead of `superinfer.cli serve`."""

        def __init__(self, label: str, rules: str, args: argparse.Namespace,
                     run_dir: Path) -> None:
            from common.daemon import free_port

            self.port = free_port()
            ports = [str(free_port()) for _ in range(4)]
            flags = [
                "--port", str(self.port), "--grpc-port", ports[0], "--scheduler-port", ports[1],
                "--worker-port", ports[2], "--kvmem-port", ports[3], "--run-dir", str(run_dir),
                "--max-restarts", "0", *engine_flags(args),
            ]
            self.argv = serve_command(rules, flags)
            run_dir.mkdir(parents=True, exist_ok=True)
            self.log = open(run_dir / "serve.out", "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
            self.base_url = f"http://127.0.0.1:{self.port}/v1"
            try:
                self._wait_ready(label, args.startup_timeout, run_dir)
            except BaseException:
                self.stop()
                raise

    return RulesStack


def bench_workload(args: argparse.Namespace) -> list[str]:
    return ["--dataset", args.dataset, "--max-prompt-len", str(args.max_prompt_len),
            "--max-output-len", str(args.max_output_len),
            "--length-scale", str(args.length_scale), "--ttft-slo", str(args.ttft_slo),
            "--tbt-slo", str(args.tbt_slo), "--no-progress", *shlex.split(args.bench_args)]


def client_command(phases: list[tuple[float, float]], base_url: str, label: str,
                   args: argparse.Namespace, path: Path) -> list[str]:
    """bench serve, in its own process, replaying the step trace (`client_main`). `--rps`
    and `--duration` satisfy bench serve's checks and name the pass; the phases decide."""
    return [sys.executable, "-m", "experiments.rate_step_real", "--step-client",
            format_phases(phases), "--base-url", base_url, "--label", label,
            *bench_workload(args), "--rps", f"{phases[0][0]:g}",
            "--duration", f"{sum(d for _, d in phases):g}", "--seed", str(args.seed),
            "--json", str(path)]


def client_main(phases_text: str, argv: list[str]) -> int:
    """`superinfer bench serve ARGV` with its trace replaced by the step trace."""
    phases = parse_phases(phases_text)
    from superinfer import cli
    from superinfer.bench.serve import cli as bench_cli
    from superinfer.workload import build_trace

    def build_step(spec: Any, tokenizer: Any = None) -> list[Any]:
        return step_trace(spec, phases, build_trace, tokenizer)

    bench_cli.build_trace = build_step  # this process only
    return cli.main(["bench", "serve", *argv])


def source_state() -> dict[str, Any]:
    """The checkout the stacks ran: its commit and the files changed from it (the rules'
    code, e.g. policy/residency.py, is what a variant measures)."""
    root = Path(__file__).resolve().parent.parent

    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    diff = git("diff", "HEAD")
    return {"commit": git("rev-parse", "HEAD"),
            "changed": None if status is None else [x[3:] for x in status.splitlines() if x],
            "diff_sha256": None if not diff else hashlib.sha256(diff.encode()).hexdigest()[:16]}


def run(args: argparse.Namespace) -> int:
    from experiments.policies import stopping_on_sigterm

    return stopping_on_sigterm(_run, args)


def _run(args: argparse.Namespace) -> int:
    prog = "python -m experiments.rate_step_real"
    try:
        variants = resolve_variants(args.variants, args.variant)
        peak = 2.0 * args.base if args.peak is None else args.peak
        phases = phases_of(args.base, peak, args.phase_s)
        parse_phases(format_phases(phases))  # positive and finite
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([prog, *sys.argv[1:]])
    from experiments.policies import machine_facts

    facts = {**machine_facts(), "source": source_state()}
    stack_class = _stack_class()
    t_start = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {}
    passes: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    for label, rules in variants.items():
        run_dir = out / f".run-{label}"
        print(f"== {label} ({rules or 'no overrides'}): starting the stack", flush=True)
        t0 = time.monotonic()
        stack = stack_class(label, rules, args, run_dir)
        try:
            print(f"== {label}: ready in {time.monotonic() - t0:.0f} s", flush=True)
            if args.warmup:
                warm = run_dir / "warmup.json"
                rc = subprocess.call(
                    [sys.executable, "-m", "superinfer.cli", "bench", "serve",
                     "--base-url", stack.base_url, "--label", label, *bench_workload(args),
                     "--rps", "inf", "--num-prompts", str(args.warmup),
                     "--seed", str(args.seed + 1), "--json", str(warm)],
                    stdout=subprocess.DEVNULL)
                if rc != 0:
                    print(f"the warm-up pass for {label} failed with code {rc}", file=sys.stderr)
                    return 1
            path = out / f"{label}.json"
            path.unlink(missing_ok=True)
            load, began = os.getloadavg(), time.strftime("%H:%M:%S", time.gmtime())
            t1 = time.monotonic()
            rc = subprocess.call(client_command(phases, stack.base_url, label, args, path))
            if rc != 0 or not path.exists():
                print(f"bench serve for {label} failed with code {rc}", file=sys.stderr)
                return 1
            step_s = time.monotonic() - t1
            bench = json.loads(path.read_text())
            results[label] = score(bench, phases)
            digests[label] = trace_digest(bench)
            (row,) = bench["results"]
            passes[label] = {
                "rules": rules, "serve_command": shlex.join(stack.argv),
                "bench_json": str(path), "pass_started_utc": began,
                "load_average_at_pass": load, "step_wall_s": round(step_s, 1),
                "variant_wall_s": round(time.monotonic() - t0, 1),
                "trace_digest": digests[label], "rotations": row.get("rotations"),
                "failed": row.get("failed"), "max_send_lag_s": row.get("max_send_lag_s"),
            }
        finally:
            stack.stop()
        print(f"== {label}: done in {time.monotonic() - t0:.0f} s", flush=True)
    same_trace = len(set(digests.values())) <= 1
    text = format_table(results)
    summary = {
        "command": command,
        "config": {**vars(args), "variants_resolved": variants, "peak": peak,
                   "phases": [{"phase": k + 1, "rate": r, "seconds": d}
                              for k, (r, d) in enumerate(phases)],
                   "serve_flags": ["--max-restarts", "0", *engine_flags(args)],
                   "bench_flags": bench_workload(args)},
        "machine": facts, "wall_s": round(time.monotonic() - t_start, 1),
        "same_trace": same_trace, "passes": passes,
        # per variant, per phase: ttft, tbt, tpot, joint (fractions), goodput, requests, ...
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    md = [f"# Rate step on the real stack ({facts['date_utc']} UTC)", "", f"`{command}`", "",
          f"Phases (req/s : s): {format_phases(phases)}; seed {args.seed}; SLOs TTFT "
          f"{args.ttft_slo} s, TBT {args.tbt_slo} s; device pool {args.device_blocks} blocks. "
          "Each request scored by the phase its arrival falls in; joint = TTFT and TPOT met "
          "(vLLM's goodput test); goodput = those requests per second of the phase.", "",
          "```", text, "```", "",
          *(f"- {k}: rules `{p['rules'] or '(none)'}`, rotations {p['rotations']}, step "
            f"{p['step_wall_s']} s, whole variant {p['variant_wall_s']} s" for k, p in
            passes.items()), "",
          f"Same trace for every variant: {same_trace} ({', '.join(sorted(set(digests.values())))})",
          ""]
    (out / "table.md").write_text("\n".join(md))
    print(text)
    if not same_trace:
        print(f"WARNING: the variants' traces differ: {digests}", file=sys.stderr)
    print(f"wrote {out}/results.json, table.md ({summary['wall_s']} s)")
    return 0 if same_trace else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--step-client"]:
        if len(argv) < 2:
            print("usage: python -m experiments.rate_step_real --step-client RATE:S,... "
                  "<bench serve argv>", file=sys.stderr)
            return 2
        return client_main(argv[1], argv[2:])
    p = argparse.ArgumentParser(prog="python -m experiments.rate_step_real",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    from common.logging import configure_logging

    configure_logging("rate-step-real", level="warning")
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
