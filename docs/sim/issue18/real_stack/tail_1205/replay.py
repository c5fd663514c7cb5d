"""Replay a real-stack chat pass (`--no-ignore-eos --max-tokens N`) in the CPU twin.

    .venv/bin/python docs/sim/issue18/real_stack/tail_1205/replay.py \\
        VARIANTS SCALE PASS_DIR:RATE ...

PASS_DIR: a stored `bench experiment` output (results.json[.gz] and one
`<policy>@<rate>.json[.gz]` per pass). The trace is the real requests as they went out:
arrival, prompt tokens (chat template included) and output tokens (at temperature 0 every
policy's replies are the same text, so one pass gives every request's length). The
scheduler does not know the lengths (the twin's "unknown" lengths, bounded by the passes'
--max-tokens), as on the real stack. VARIANTS as twin_seeds.py's (lvf,swapped-first,...,
or lvf:key=value:label=x). SCALE: every execution cost times this (1: the cpu-local
profile). Prints, per variant, TTFT / per-gap TBT / TPOT %, good requests, vLLM
goodput, the tail past the last arrival, the requests unfinished at it, and the claim.
"""

from __future__ import annotations

import gzip
import json
import shlex
import sys
from pathlib import Path

from superinfer.bench.experiment import pareto_claim
from superinfer.sim import fidelity
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.sim.report import result_row
from superinfer.workload import TraceRequest


def load(path: Path) -> dict:
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return json.load(gzip.open(gz))
    return json.loads(path.read_text())


def replay_trace(pass_json: dict) -> list[TraceRequest]:
    per = pass_json["results"][0]["per_request"]
    return [TraceRequest(q["index"], q["scheduled_s"], int(q["prompt_tokens"]),
                         max(1, int(q["output_tokens"]))) for q in per]


def max_tokens_of(bench_args: str) -> int | None:
    args = shlex.split(bench_args or "")
    return int(args[args.index("--max-tokens") + 1]) if "--max-tokens" in args else None


def tail(res, last_arrival: float) -> tuple[float, int]:
    ends = [r.token_times[-1] for r in res.records if r.token_times]
    unfinished = sum(1 for t in ends if t > last_arrival)
    return max(ends) - last_arrival, unfinished


# The passes of stores without a results.json ran with these same serve and bench flags.
FLAGS_FROM = Path(__file__).parent.parent / "repeats_1205/seeds/main_s15"


def replay(d: Path, rate: str, vs: list[PolicyVariant], hw, model) -> dict[str, bool]:
    config = load((d if (d / "results.json.gz").exists() else FLAGS_FROM) / "results.json")["config"]
    first = sorted(d.glob(f"*@{rate}.json*"))[0]
    trace = replay_trace(load(first.with_suffix("") if first.suffix == ".gz" else first))
    last_arrival = max(t.arrival_s for t in trace)
    rows = {}
    print(f"{d} at {rate} req/s ({len(trace)} requests, "
          f"{sum(t.output_len for t in trace)} output tokens)")
    for v in vs:
        ec, transfer = fidelity.engine_config(config, v.policy)
        cfg = v.apply(SimConfig.from_engine(ec, **transfer, lengths="unknown",
                                            max_tokens=max_tokens_of(config["bench_args"])))
        res = Simulator(hw, model, v.policy, cfg, label=v.label).run(trace, None)
        row = {**result_row(float(rate), res), "policy": v.label}
        t, n = tail(res, last_arrival)
        rows[v.label] = row
        print(f"  {v.label:<22} {100 * row['ttft_attainment']:5.1f} / "
              f"{100 * row['tbt_attainment']:5.2f} / {100 * row['tpot_attainment']:5.1f}  "
              f"good {row['good_requests']:>3}  goodput {row['goodput_rps']:.3f}  "
              f"tail {t:5.1f} s  unfinished {n:>2}  rotations "
              f"{res.stats.get('preemptions', 0):>4}  tok/s {row['throughput_tok_s']:.0f}",
              flush=True)
    lvfs = [v.label for v in vs if v.policy == "lvf"]
    base = [r for label, r in rows.items() if label not in lvfs]
    held = {}
    for label in lvfs:
        c = pareto_claim([*base, {**rows[label], "policy": "lvf"}], float(config["saturation"]))
        held[label] = bool(c["holds"])
        print(f"  {label}: claim {'holds' if c['holds'] else 'FAILS'}")
    return held


def main(variants: str, scale: str, *cells: str) -> None:
    hw = fidelity.scaled_hardware(load_hardware("cpu-local"), float(scale))
    model = load_model("smollm2-135m")
    vs = [PolicyVariant.parse(v) for v in variants.split(",")]
    tally: dict[str, int] = {}
    for cell in cells:
        d, _, rate = cell.rpartition(":")
        for label, ok in replay(Path(d), rate, vs, hw, model).items():
            tally[label] = tally.get(label, 0) + ok
    for label, k in tally.items():
        print(f"{label} holds the claim in {k} of {len(cells)} cells")


if __name__ == "__main__":
    main(*sys.argv[1:])
