"""`python -m experiments policies`: the mission's claim on the real stack, on this machine.

For each policy it starts the whole stack (`superinfer serve`: worker, kvmem, scheduler,
gateway as separate processes) on the bundled model with a device pool small enough that
KV memory, not compute, limits the load, sweeps request rates with `superinfer bench
serve` (a separate client process), and stops the stack. Then it writes to `--out`:

* `results.json` — config, machine facts, every pass's summary (the simulator's keys), and
  the claim check below;
* `table.md` — attainment and latency per rate and policy, and the claim check;
* `attainment.png` — TTFT and TBT attainment vs rate per policy (like the paper's Fig. 16);
* `command.txt` — the exact command; `<policy>.json` — bench serve's own output
  (per-request details); `<policy>.trace.json` with `--trace` (iteration timelines).

`--variant LABEL=POLICY [FLAGS]` adds a pass per rate for POLICY with more `serve` flags,
named LABEL in every table and file (an A/B of an option within one interleaved sweep, on
the same machine state); `python -m experiments fidelity` replays it with those flags.

The claims checked: the TTFT gain (at the highest rate where any policy keeps TBT attainment
>= 90 %, `lvf` raises TTFT attainment over `swapped-first` by >= 20 points with TBT
attainment within 5 points) and the Pareto claim (at the rates from 1.5x the saturation rate
up, `lvf` is on the Pareto front of (TTFT, per-gap TBT attainment) against every other
policy, and its goodput as vLLM counts it is >= each of theirs). `--saturation R` sweeps
0.5, 1, 1.5 and 2 x R; `--num-prompts N` sends N requests per pass (>= 100, or one
request is worth several points), instead of `--duration` seconds of arrivals.

SLOs scale the paper's to this CPU (DESIGN 8: 5 s TTFT, 100 ms TBT on a GH200, where a
decode iteration of Qwen2.5-32B takes ~40 ms): the TBT SLO is ~2.5 decode iterations and
the TTFT SLO ~125 iterations. Here a decode iteration of the bundled model at the batch the
small pool allows is ~80–120 ms (docs/results/executor/), hence the defaults of
300 ms and 10 s; `--ttft-slo/--tbt-slo` change them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common.config import POLICY_NAMES
from common.daemon import free_port
from superinfer.bench.report import table
from superinfer.bench.serve.summary import format_misses

POLICIES = "lvf,swapped-first,waiting-first,fcfs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--rates", default=None,
                   help="request rates (req/s) to sweep (default 0.4,1.0,1.6,2.4: from under the "
                        "~0.7 req/s the small pool serves to ~3x over it; with --saturation, "
                        "0.5, 1, 1.5 and 2 x it)")
    p.add_argument("--saturation", type=float, default=None,
                   help="the measured saturation rate (req/s): the Pareto claim is checked "
                        "at the rates >= 1.5 x it; without --rates, sweep 0.5, 1, 1.5, 2 x it")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per pass (instead of --duration)")
    p.add_argument("--slo-classes", default=None,
                   help="heterogeneous SLOs for bench serve (e.g. 'mixed')")
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--max-prompt-len", type=int, default=384)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=10.0, help="seconds (see module doc)")
    p.add_argument("--tbt-slo", type=float, default=0.3, help="seconds (see module doc)")
    p.add_argument("--device-blocks", type=int, default=64,
                   help="device KV pool in 16-token blocks: small, so memory limits the load")
    p.add_argument("--host-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--serve-args", default="",
                   help="more flags for `superinfer serve`, e.g. '--xfer-budget-blocks 64'")
    p.add_argument("--bench-args", default="",
                   help="more flags for every `superinfer bench serve` pass, e.g. "
                        "'--endpoint chat --no-ignore-eos --max-tokens 256' (requests whose "
                        "length the server does not know; the model's EOS ends them)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=POLICY [FLAGS]",
                   help="one more pass per rate, labelled LABEL: POLICY with FLAGS added to "
                        "`serve`'s, e.g. 'lvf-serial=lvf --no-pipeline' (repeatable); with "
                        "--interleave it runs beside the policies it is compared with. The "
                        "claims are checked for lvf as before, and again for each lvf variant "
                        "in lvf's place, against the baselines only")
    p.add_argument("--trace", action="store_true", help="write each policy's iteration trace")
    p.add_argument("--interleave", action="store_true",
                   help="rates outside, policies inside (a fresh stack per pass, the policy "
                        "order reversed at every other rate), so that every policy's pass at "
                        "a rate runs close in time to the others' on a machine whose load "
                        "drifts; writes <policy>@<rate>.json per pass (with --trace, the "
                        "last pass's trace per policy)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every (policy, rate) pass N times, in rounds (the policy order "
                        "reversed every other round); the claims are checked on the mean of "
                        "the N passes, and once per round (how many rounds each holds in). "
                        "One pass's goodput moves with the machine's speed by more than the "
                        "policies differ where all meet their SLOs; N passes show by how much")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="requests each fresh stack serves (all at once, another seed) before "
                        "its pass is measured: a cold stack serves its first ~40 s slower")
    p.add_argument("--out", default=".experiments/policies", help="output directory")
    p.add_argument("--startup-timeout", type=float, default=300.0)




def machine_facts() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    import torch

    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib,
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def parse_variants(specs: list[str], policies: list[str]) -> dict[str, dict[str, str]]:
    """`--variant LABEL=POLICY [FLAGS]` -> {label: {"policy": POLICY, "serve_args": FLAGS}}."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        label, words = label.strip(), rest.split(None, 1)
        if not sep or not label or not words:
            raise ValueError(f"--variant {spec!r}: expected LABEL=POLICY [FLAGS], e.g. "
                             "'lvf-serial=lvf --no-pipeline'")
        if label in POLICY_NAMES or label in policies or label in out:
            raise ValueError(f"--variant {spec!r}: the label {label!r} is taken (a policy's "
                             "name or another variant's); choose another")
        if not all(c.isalnum() or c in "-_." for c in label):
            raise ValueError(f"--variant {spec!r}: a label is letters, digits, '-', '_' and "
                             "'.' only (it names the pass's files)")
        if words[0] not in POLICY_NAMES:
            raise ValueError(f"--variant {spec!r}: unknown policy {words[0]!r}; choose one "
                             f"of {', '.join(POLICY_NAMES)}")
        out[label] = {"policy": words[0], "serve_args": words[1] if len(words) > 1 else ""}
    return out


def base_policy(name: str, config: dict[str, Any]) -> str:
    """The policy a pass named `name` ran: its own name, or its variant's policy."""
    variant = (config.get("variants") or {}).get(name)
    return name if variant is None else str(variant["policy"])


def engine_argv(policy: str, config: dict[str, Any]) -> list[str]:
    """The engine flags `serve` gets for one policy or variant label (`superinfer sim
    fidelity` reads them too); a variant's own flags come after `--serve-args`."""
    variant = (config.get("variants") or {}).get(policy) or {}
    return [
        "--policy", base_policy(policy, config), "--device-blocks", str(config["device_blocks"]),
        "--host-blocks", str(config["host_blocks"]), "--max-num-seqs", str(config["max_num_seqs"]),
        "--ttft-slo", str(config["ttft_slo"]), "--tbt-slo", str(config["tbt_slo"]),
        *shlex.split(config["serve_args"]), *shlex.split(variant.get("serve_args", "")),
    ]


class Stack:
    """`superinfer serve` for one policy, on free ports, in its own run directory."""

    def __init__(self, policy: str, args: argparse.Namespace, run_dir: Path) -> None:
        self.port = free_port()
        ports = [str(free_port()) for _ in range(4)]
        argv = [
            sys.executable, "-m", "superinfer.cli", "serve",
            "--port", str(self.port), "--grpc-port", ports[0], "--scheduler-port", ports[1],
            "--worker-port", ports[2], "--kvmem-port", ports[3], "--run-dir", str(run_dir),
            "--max-restarts", "0", *engine_argv(policy, vars(args)),
        ]
        if args.trace:
            argv += ["--trace", str(Path(args.out).resolve() / f"{policy}.trace.json")]
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "serve.out", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        try:
            self._wait_ready(policy, args.startup_timeout, run_dir)
        except BaseException:  # a failed start, or the experiment stopped meanwhile
            self.stop()
            raise

    def _wait_ready(self, policy: str, timeout_s: float, run_dir: Path) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`superinfer serve` for {policy} exited with "
                                   f"{self.proc.returncode}: see {run_dir / 'serve.out'}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1.0,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack for {policy} was not ready in "
                                   f"{timeout_s:.0f} s: see {run_dir / 'serve.out'}")
            time.sleep(0.5)

    def stop(self) -> None:
        # SIGTERM, which serve handles as Ctrl-C: SIGINT is ignored by every process of an
        # experiment started in the background (nohup, `&` in a script), so serve never
        # saw it, and each stack was killed after the 60 s below, its services undrained.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def claim(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The TTFT-gain claim (module doc), checked on the sweep's results (`holds` None: not checkable,
    the sweep did not run both lvf and swapped-first)."""
    policies = {r["policy"] for r in rows}
    if not {"lvf", "swapped-first"} <= policies:
        return {"rate": None, "holds": None,
                "why": "needs both lvf and swapped-first in --policies"}
    ok_rates = [r["rps"] for r in rows if (r.get("tbt_attainment") or 0.0) >= 0.9]
    if not ok_rates:
        return {"rate": None, "holds": False,
                "why": "no policy kept TBT attainment >= 90 % at any rate"}
    rate = max(ok_rates)
    at = {r["policy"]: r for r in rows if r["rps"] == rate}
    lvf, sf = at.get("lvf"), at.get("swapped-first")
    if lvf is None or sf is None:
        return {"rate": rate, "holds": False, "why": "lvf or swapped-first missing at that rate"}
    d_ttft = 100 * (lvf["ttft_attainment"] - sf["ttft_attainment"])
    best_tbt = max(r["tbt_attainment"] for r in at.values() if r.get("tbt_attainment") is not None)
    d_tbt = 100 * (best_tbt - lvf["tbt_attainment"])
    return {
        "rate": rate, "ttft_gain_points": round(d_ttft, 1),
        "tbt_gap_to_best_points": round(d_tbt, 1),
        "tbt_gap_to_swapped_first_points": round(
            100 * (sf["tbt_attainment"] - lvf["tbt_attainment"]), 1),
        "holds": d_ttft >= 20.0 and d_tbt <= 5.0,
    }


# Attainment points within which two passes tie on the Pareto check: the threshold of the
# simulator's must-show check (experiments/must_show.py, which applies it to values
# rounded to 0.1 points; here it applies to the raw ones). A pass of 100 requests has ~28,000 gaps
# at 99.4 % per-gap TBT attainment: one pass's sampling error alone is ~0.05 points
# (sqrt(p(1-p)/n)), 14 gaps. TTFT counts requests, a point each, so its ties stay exact.
TIE_POINTS = 0.05


def _dominators(lvf: dict[str, Any], others: list[dict[str, Any]], tie: float) -> list[str]:
    """The policies at least as good as lvf on TTFT and per-gap TBT attainment and better on
    one, where a difference of `tie` points or less is no difference."""
    t = tie / 100.0
    a = (lvf["ttft_attainment"] or 0.0, lvf["tbt_attainment"] or 0.0)
    out = []
    for r in others:
        b = (r["ttft_attainment"] or 0.0, r["tbt_attainment"] or 0.0)
        if all(b[i] >= a[i] - t for i in (0, 1)) and any(b[i] > a[i] + t for i in (0, 1)):
            out.append(r["policy"])
    return out


def pareto_claim(rows: list[dict[str, Any]], saturation: float | None) -> dict[str, Any]:
    """The Pareto claim at the rates >= 1.5x `saturation`: no other policy is at least as
    good on both TTFT and per-gap TBT attainment and better on one (beyond `TIE_POINTS`),
    and lvf's goodput (vLLM's) is >= each of theirs. `holds` None: not checkable.
    `dominated_by_strict` / `holds_strict` are the same check with exact ties."""
    if saturation is None:
        return {"holds": None, "why": "needs --saturation (the measured saturation rate)"}
    rates = sorted({r["rps"] for r in rows if r["rps"] >= 1.5 * saturation - 1e-9})
    if not rates or not any(r["policy"] == "lvf" for r in rows):
        return {"holds": None, "why": "needs lvf and a rate >= 1.5x the saturation rate"}
    per_rate = []
    for rate in rates:
        at = {r["policy"]: r for r in rows if r["rps"] == rate}
        lvf = at.get("lvf")
        if lvf is None:
            continue
        others = [r for p, r in at.items() if p != "lvf"]
        dominated_by = _dominators(lvf, others, TIE_POINTS)
        strict = _dominators(lvf, others, 0.0)
        best = max((r["goodput_rps"] or 0.0 for r in others), default=0.0)
        good = (lvf["goodput_rps"] or 0.0) >= best
        # vLLM's goodput is good requests over the pass's makespan; where every policy meets
        # nearly every SLO, the makespan follows the machine's speed during the pass, which
        # drifted by up to a quarter between passes minutes apart here. The good requests'
        # count does not: it is shown beside.
        per_rate.append({"rate": rate, "dominated_by": dominated_by,
                         "dominated_by_strict": strict,
                         "goodput": lvf["goodput_rps"], "best_other_goodput": best,
                         "good_requests": lvf.get("good_requests"),
                         "most_other_good_requests": max(
                             (r.get("good_requests") or 0 for r in others), default=0),
                         "holds": not dominated_by and good,
                         "holds_strict": not strict and good})
    return {"rates": per_rate, "tie_points": TIE_POINTS,
            "holds": all(r["holds"] for r in per_rate) if per_rate else None,
            "holds_strict": all(r["holds_strict"] for r in per_rate) if per_rate else None}


def check_claims(rows: list[dict[str, Any]], variants: dict[str, dict[str, str]],
                 saturation: float | None) -> dict[str, Any]:
    """Both claims on the plain policies' passes (a variant is nobody's baseline), then
    the Pareto claim again for each lvf variant in lvf's place, against the passes of the
    policies that are not lvf."""
    plain = [r for r in rows if r["policy"] not in variants]
    baselines = [r for r in plain if r["policy"] != "lvf"]
    return {
        "ttft_gain_claim": claim(plain), "pareto_claim": pareto_claim(plain, saturation),
        "pareto_claim_variants": {
            label: pareto_claim(
                baselines + [{**r, "policy": "lvf"} for r in rows if r["policy"] == label],
                saturation)
            for label, v in variants.items() if v["policy"] == "lvf"},
    }


# The per-pass figures averaged over a (policy, rate)'s repeated passes.
MEAN_KEYS = ["ttft_attainment", "tbt_attainment", "tpot_attainment", "p50_ttft_s", "p99_ttft_s",
             "p50_tbt_s", "p99_tbt_s", "good_requests", "goodput_rps", "goodput_every_gap_rps",
             "throughput_tok_s", "rotations", "requests", "completed", "failed"]


def mean_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, rate): each of MEAN_KEYS averaged over the passes that have
    it (None where none has), `passes` counted, and goodput's lowest and highest pass."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["rps"]), []).append(r)
    out = []
    for (policy, rps), group in groups.items():
        row: dict[str, Any] = {"policy": policy, "rps": rps, "passes": len(group)}
        for k in MEAN_KEYS:
            values = [r[k] for r in group if r.get(k) is not None]
            row[k] = sum(values) / len(values) if values else None
        goodputs = [r["goodput_rps"] for r in group if r.get("goodput_rps") is not None]
        row["goodput_rps_min"] = min(goodputs, default=None)
        row["goodput_rps_max"] = max(goodputs, default=None)
        out.append(row)
    return out


def claims_per_round(rows: list[dict[str, Any]], variants: dict[str, dict[str, str]],
                     saturation: float | None) -> dict[str, Any]:
    """`check_claims` on each round's passes alone, and per claim the rounds it held in."""
    rounds = sorted({r.get("repeat", 1) for r in rows})
    each = {k: check_claims([r for r in rows if r.get("repeat", 1) == k], variants, saturation)
            for k in rounds}

    def held(pick: Any) -> list[int] | None:  # None: checkable in no round
        if all(pick(c).get("holds") is None for c in each.values()):
            return None
        return [k for k, c in each.items() if pick(c).get("holds")]

    return {
        "rounds": len(rounds),
        "ttft_gain_claim_held_in_rounds": held(lambda c: c["ttft_gain_claim"]),
        "pareto_claim_held_in_rounds": held(lambda c: c["pareto_claim"]),
        "pareto_claim_variants_held_in_rounds": {
            label: held(lambda c, label=label: c["pareto_claim_variants"][label])
            for label in next(iter(each.values()))["pareto_claim_variants"]} if each else {},
        "per_round": {str(k): c for k, c in each.items()},
    }


KEYS = ["policy", "rps", "requests", "completed", "failed", "ttft_attainment", "tbt_attainment",
        "tpot_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s", "p99_tbt_s", "good_requests",
        "goodput_rps", "goodput_every_gap_rps", "throughput_tok_s", "rotations"]


MEAN_TABLE = ["policy", "rps", "passes", "ttft_attainment", "tbt_attainment", "tpot_attainment",
              "good_requests", "goodput_rps", "goodput_rps_min", "goodput_rps_max", "rotations"]


def pass_order(policies: list[str], rates: list[str], interleave: bool,
               repeats: int) -> list[tuple[str, str, int]]:
    """(policy, rates, round) per pass. Interleaved: rates outside, policies inside, the
    policy order reversed at every other rate and, from round to round, at every other
    start, so that no policy always runs first or last after another's stack; else each
    policy sweeps every rate in one pass, the order reversed every other round."""
    out = []
    for k in range(repeats):
        if interleave:
            out += [(p, r, k + 1) for i, r in enumerate(rates)
                    for p in (policies if (i + k) % 2 == 0 else policies[::-1])]
        else:
            out += [(p, ",".join(rates), k + 1)
                    for p in (policies if k % 2 == 0 else policies[::-1])]
    return out


def _rounds(held: list[int] | None) -> str:
    return "not checkable" if held is None else f"{held} ({len(held)})"


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 3)
    return "-" if v is None else v


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: the bench client is killed, the stack stopped


def stopping_on_sigterm(body: Callable[[argparse.Namespace], int],
                        args: argparse.Namespace) -> int:
    """`body(args)` with SIGTERM turned into SystemExit, so that its `finally` blocks stop
    the stacks and clients it started (a study killed from outside leaves no process)."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return body(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    return stopping_on_sigterm(_run, args)


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "experiments", "policies", *sys.argv[2:]])
    facts = machine_facts()
    if args.saturation is not None:
        if not args.saturation > 0:
            print("python -m experiments policies: error: --saturation must be a positive rate "
                  "in req/s", file=sys.stderr)
            return 2
        if args.rates is None:
            args.rates = ",".join(f"{f * args.saturation:g}" for f in (0.5, 1.0, 1.5, 2.0))
    if args.rates is None:
        args.rates = "0.4,1.0,1.6,2.4"
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        args.variants = parse_variants(args.variant, policies)
    except ValueError as e:
        print(f"python -m experiments policies: error: {e}", file=sys.stderr)
        return 2
    policies += list(args.variants)
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    if args.repeats < 1:
        print("python -m experiments policies: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    passes = pass_order(policies, args.rates.split(","), args.interleave, args.repeats)
    for policy, rates, round_ in passes:
        run_dir = out / f".run-{policy}"
        print(f"== {policy}: starting the stack" + (f" (rate {rates})" if args.interleave else "")
              + (f", round {round_} of {args.repeats}" if args.repeats > 1 else ""), flush=True)
        stack = Stack(policy, args, run_dir)
        try:
            stem = f"{policy}@{rates}" if args.interleave else policy
            path = out / (f"{stem}.r{round_}.json" if args.repeats > 1 else f"{stem}.json")
            workload = [
                *(["--slo-classes", args.slo_classes] if args.slo_classes else []),
                "--dataset", args.dataset,
                "--max-prompt-len", str(args.max_prompt_len),
                "--max-output-len", str(args.max_output_len),
                "--length-scale", str(args.length_scale),
                "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo), "--no-progress",
                *shlex.split(args.bench_args),
            ]
            serve = [sys.executable, "-m", "superinfer.cli", "bench", "serve",
                     "--base-url", stack.base_url, "--label", policy, *workload]
            if args.warmup:
                warm = run_dir / "warmup.json"
                if subprocess.call([*serve, "--sweep-rps", "inf", "--num-prompts",
                                    str(args.warmup), "--seed", str(args.seed + 1),
                                    "--json", str(warm)], stdout=subprocess.DEVNULL) != 0:
                    print(f"the warm-up pass for {policy} failed", file=sys.stderr)
                    return 1
            bench = [
                *serve, "--sweep-rps", rates,
                *(["--num-prompts", str(args.num_prompts)] if args.num_prompts
                  else ["--duration", str(args.duration)]),
                "--seed", str(args.seed), "--json", str(path),
            ]
            load, began = os.getloadavg(), time.strftime("%H:%M:%S", time.gmtime())
            rc = subprocess.call(bench)
            if rc != 0 or not path.exists():
                print(f"bench serve for {policy} failed with code {rc}", file=sys.stderr)
                return 1
            for r in json.loads(path.read_text())["results"]:
                # What the machine was doing: the 1/5/15-min load average as the pass began.
                rows.append({**r, "base_policy": base_policy(policy, vars(args)),
                             "pass_started_utc": began, "load_average_at_pass": load,
                             **({"repeat": round_} if args.repeats > 1 else {})})
        finally:
            stack.stop()
    # Per policy by rate (an infinite rate, every request at t = 0, has rps None: last).
    rows.sort(key=lambda r: (policies.index(r["policy"]),
                             math.inf if r["rps"] is None else r["rps"], r.get("repeat", 1)))
    rated = [r for r in rows if r["rps"] is not None]  # the claims and the plot need rates
    means = mean_rows(rated) if args.repeats > 1 else rated
    claims = check_claims(means, args.variants, args.saturation)
    verdict, pareto = claims["ttft_gain_claim"], claims["pareto_claim"]
    rounds = claims_per_round(rated, args.variants, args.saturation) if args.repeats > 1 else None
    summary = {"command": command, "config": vars(args), "machine": facts,
               "wall_s": round(time.monotonic() - t_start, 1), "results": rows,
               **({"means": means, "claims_per_round": rounds} if rounds else {}), **claims}
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "command.txt").write_text(command + "\n")
    keys = KEYS if args.repeats == 1 else ["repeat", *KEYS]
    text = table(keys, [[_cell(r.get(k)) for k in keys] for r in rows])
    mean_text = table(MEAN_TABLE, [[_cell(r.get(k)) for k in MEAN_TABLE] for r in means]
                      ) if rounds else ""
    held = [] if rounds is None else [
        f"Rounds the claims held in, of {rounds['rounds']}: TTFT gain "
        f"{_rounds(rounds['ttft_gain_claim_held_in_rounds'])}, Pareto "
        f"{_rounds(rounds['pareto_claim_held_in_rounds'])}"
        + "".join(f", {label} in lvf's place {_rounds(ks)}" for label, ks in
                  rounds["pareto_claim_variants_held_in_rounds"].items())]
    misses = [f"{r['policy']} @ {'inf' if r['rps'] is None else format(r['rps'], 'g')}"
              + (f" round {r['repeat']}" if "repeat" in r else "") + f": {line}"
              for r in rows for line in format_misses(r)]
    md = [f"# Experiment: rotation policies on the real stack ({facts['date_utc']} UTC)", "",
          f"`{command}`", "",
          f"Machine: {facts['cpu']}, {facts['cores']} cores, {facts['memory_gib']} GiB; "
          f"torch {facts['torch']}. Load average at start: {facts['load_average_at_start']}.",
          f"SLOs: TTFT {args.ttft_slo} s, TBT {args.tbt_slo} s. Device pool "
          f"{args.device_blocks} blocks x 16 tokens, host pool {args.host_blocks} blocks.", "",
          "```", text, "```", "",
          *([f"Mean over the {args.repeats} passes of each (policy, rate); the claims below "
             "are checked on these:", "", "```", mean_text, "```", "", *held, ""] if rounds
            else []),
          f"Claim check (TTFT gain): `{json.dumps(verdict)}`", "",
          f"Claim check (Pareto): `{json.dumps(pareto)}`", "",
          *(f"Claim check (Pareto), {label} in lvf's place: `{json.dumps(c)}`\n"
            for label, c in claims["pareto_claim_variants"].items()),
          "Where the missed requests' time went (the server's /metrics, per pass):", "",
          "```", *misses, "```", ""]
    (out / "table.md").write_text("\n".join(md))
    from superinfer.sim.plots import rate_plot as plot

    plot(means, str(out / "attainment.png"),
         f"real stack, bundled model, {args.device_blocks}-block device pool; SLOs "
         f"TTFT {args.ttft_slo} s / TBT {args.tbt_slo} s")
    print(text)
    if rounds:
        print(f"mean over the {args.repeats} passes of each (policy, rate):")
        print(mean_text)
        print("\n".join(held))
    print("\n".join(misses))
    print(f"claim (TTFT gain): {json.dumps(verdict)}")
    print(f"claim (Pareto): {json.dumps(pareto)}")
    for label, c in claims["pareto_claim_variants"].items():
        print(f"claim (Pareto), {label} in lvf's place: {json.dumps(c)}")
    print(f"wrote {out}/results.json, table.md, attainment.png ({summary['wall_s']} s)")
    return 0
