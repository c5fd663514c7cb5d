"""`superinfer sim`: sweep policies x request rates on a simulated machine (DESIGN 7).

    superinfer sim --hardware gh200 --model qwen2.5-32b --dataset sharegpt \\
        --rps 5,8,11,14,17,20 --duration 120 --policies lvf,swapped-first,waiting-first,fcfs \\
        --json out.json --plot out.png
    superinfer sim calibrate            # measure this machine -> profiles/hardware/cpu-local.json

The scheduling flags are `serve`'s (common/scheduling.py). A policy entry may carry per-run
overrides, e.g. `lvf:xfer=300:layout=layer-first:duplex=off:eager=0:label=lvf-vllm-offload`:
the settings and the simulated machine's (xfer, eager, layout, duplex, pipeline, cost) and,
for what-if studies, LVF's rules, which have no flag of their own (alpha, beta_b, beta_f,
stall, min_res, margin, hold, tbt_budget, prefill, lazy, lazy_margin, parked_first, cover,
room, memory_margin: scheduler_svc/policy/), so one command can run an ablation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from common.scheduling import SETTING_NAMES, add_setting_flags
from superinfer.argtypes import rates
from superinfer.sim.cost import LAYOUTS
from superinfer.sim.engine import (
    AUTO,
    LENGTHS,
    PolicyVariant,
    SimConfig,
    SimResult,
    SimulationError,
    parse_budget,
    simulate,
)
from superinfer.sim.plots import rate_plot
from superinfer.sim.profile import (
    HardwareProfile,
    ModelProfile,
    ProfileError,
    available,
    load_hardware,
    load_model,
)
from superinfer.sim.report import (
    format_classes,
    format_misses,
    format_preemptions,
    format_table,
    result_row,
)
from superinfer.workload import (
    SYNTHETIC,
    WorkloadError,
    WorkloadSpec,
    build_trace,
    length_counter,
    parse_slo_classes,
    trace_stats,
)

_D = SimConfig()  # the defaults (the engine's scheduling defaults; superinfer/sim/engine.py)

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim", help="simulate the scheduler on a modelled machine (policies x request rates)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    ssub = p.add_subparsers(dest="sim_command")
    c = ssub.add_parser("calibrate", help="measure this machine and write the cpu-local profile")
    c.add_argument("--out", default=None,
                   help="where to write the profile (default: the bundled cpu-local.json)")
    c.add_argument("--quick", action="store_true", help="fewer repetitions (a rough profile)")
    c.set_defaults(func=_calibrate)


def _budget(text: str) -> int | None:
    try:
        return parse_budget(text)
    except SimulationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("machine and model")
    m.add_argument("--hardware", default="gh200",
                   help=f"hardware profile: {', '.join(available('hardware'))} or a .json path")
    m.add_argument("--model", default="qwen2.5-32b",
                   help=f"model profile: {', '.join(available('models'))} or a .json path")
    m.add_argument("--block-size", type=int, default=_D.block_size)
    m.add_argument("--device-blocks", type=int, default=None,
                   help="override the device KV pool (default: from the profiles)")
    m.add_argument("--host-blocks", type=int, default=None,
                   help="override the host KV pool (default: from the profiles)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="sharegpt",
                   help=f"synthetic ({', '.join(SYNTHETIC)}) or a ShareGPT JSON file")
    w.add_argument("--tokenizer", default=None,
                   help="count a dataset file's lengths with this tokenizer ('bundled', a .gguf "
                        "or a HF dir); default: characters / 4")
    w.add_argument("--rps", type=rates, default=[5.0, 10.0, 15.0],
                   help="request rates to sweep, comma separated")
    w.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="exactly this many requests (instead of --duration)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-prompt-len", type=int, default=1024)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply sampled lengths before clipping")
    w.add_argument("--lengths", choices=list(LENGTHS), default="known",
                   help="what the scheduler knows of output lengths: known (ignore_eos and "
                        "max_tokens = the length, as vLLM bench sends) or unknown (no "
                        "max_tokens: the context bounds it, and it ends by EOS)")
    s = p.add_argument_group("scheduling (RotaSched)")
    s.add_argument("--policies", default="lvf,swapped-first,waiting-first,fcfs",
                   help="comma-separated policies, each optionally name:key=value:...")
    s.add_argument("--iteration-cost", choices=["online", "model", "none"], default=_D.cost,
                   help="what the scheduler knows of batch times: a fit of the simulated "
                        "executor's times as the service does (online), the cost model "
                        "itself (model), or nothing (none)")
    s.add_argument("--slo-classes", default=None,
                   help="heterogeneous SLOs: 'mixed' (interactive 1 s/50 ms and batch "
                        "20 s/500 ms, half each) or name=TTFT:TBT:SHARE,... in seconds; each "
                        "request carries its class's SLOs")
    add_setting_flags(s, skip=("policy",))
    t = p.add_argument_group("transfers (DuplexKV)")
    t.add_argument("--eager-budget-blocks", type=_budget, default=AUTO,
                   help="eager D2H copies per iteration: a count, 0 (off) or 'auto' (what the "
                        "link copies during one decode iteration)")
    t.add_argument("--layout", choices=list(LAYOUTS), default="block-first")
    t.add_argument("--duplex", action=argparse.BooleanOptionalAction, default=True,
                   help="both copy directions at once (default) or one at a time")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write config and results")
    o.add_argument("--plot", default=None, metavar="PATH.png",
                   help="TTFT and TBT attainment vs RPS, per policy")
    o.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    o.add_argument("--max-sim-s", type=float, default=None,
                   help="stop each run's clock here (default: 10x the trace + 600 s)")


def _die(msg: str) -> int:
    print(f"superinfer sim: error: {msg}", file=sys.stderr)
    return 2


def build_config(args: argparse.Namespace) -> SimConfig:
    if args.eager_budget_blocks is None:
        raise SimulationError("--eager-budget-blocks takes a count, 0 or auto")
    settings = {name: getattr(args, name) for name in SETTING_NAMES if hasattr(args, name)}
    return SimConfig(
        **settings,
        block_size=args.block_size,
        cost=args.iteration_cost,
        eager_budget_blocks=args.eager_budget_blocks,
        layout=args.layout,
        duplex=args.duplex,
        device_blocks=args.device_blocks,
        host_blocks=args.host_blocks,
        max_sim_s=args.max_sim_s,
        lengths=args.lengths,
    )


def workload_spec(args: argparse.Namespace, rps: float) -> WorkloadSpec:
    return WorkloadSpec(
        dataset=args.dataset,
        rps=rps,
        duration_s=None if args.num_prompts is not None else args.duration,
        num_prompts=args.num_prompts,
        burstiness=args.burstiness,
        seed=args.seed,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
        length_scale=args.length_scale,
        slo_classes=parse_slo_classes(args.slo_classes),
    )


# A task runs in a worker process: everything it needs is picklable.
_Task = tuple[HardwareProfile, ModelProfile, PolicyVariant, SimConfig, WorkloadSpec, str | None]


def _run_task(task: _Task) -> tuple[float, SimResult]:
    hw, model, variant, cfg, spec, tokenizer = task
    trace = build_trace(spec, length_counter(tokenizer))
    result = simulate(hw, model, variant, cfg, trace, spec.trace_duration_s)
    result.records = []  # not needed by the caller; keeps the pipe small
    return spec.rps, result


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        hw = load_hardware(args.hardware)
        model = load_model(args.model)
        cfg = build_config(args)
        variants = [PolicyVariant.parse(s) for s in args.policies.split(",") if s.strip()]
        if not variants:
            return _die("give at least one policy")
        if len({v.label for v in variants}) != len(variants):
            return _die("two policy entries have the same label; add :label=NAME")
        for v in variants:
            v.apply(cfg)  # validates overrides early
        specs = [workload_spec(args, rps) for rps in args.rps]
        traces = {spec.rps: build_trace(spec, length_counter(args.tokenizer)) for spec in specs}
    except (ProfileError, WorkloadError, SimulationError) as e:
        return _die(str(e))
    if args.jobs < 1:
        return _die("--jobs must be at least 1")
    tasks: list[_Task] = [
        (hw, model, v, cfg, spec, args.tokenizer) for spec in specs for v in variants
    ]
    try:
        if args.jobs == 1 or len(tasks) == 1:
            done = [_run_task(t) for t in tasks]
        else:
            import multiprocessing as mp

            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(min(args.jobs, len(tasks))) as pool:
                done = pool.map(_run_task, tasks, chunksize=1)
    except (WorkloadError, SimulationError) as e:
        return _die(str(e))
    rows = [result_row(rps, r) for rps, r in done]
    wall = time.perf_counter() - t0

    first = done[0][1].stats
    print(f"{hw.name} + {model.name}: {first['device_blocks']} device / {first['host_blocks']} "
          f"host KV blocks of {float(first['block_bytes'] or 0) / 2**20:.2f} MiB; "
          f"B_xfer {first['xfer_budget_blocks']}, eager {first['eager_budget_blocks']} "
          f"blocks/iteration (first policy)")
    for spec in specs:
        st = trace_stats(traces[spec.rps])
        print(f"\nRPS {spec.rps:g}: {st['requests']} requests ({args.dataset}, prompt mean "
              f"{st.get('prompt_mean', 0):.0f}, output mean {st.get('output_mean', 0):.0f}); "
              f"SLOs TTFT {cfg.ttft_slo:g} s, TBT {cfg.tbt_slo * 1000:g} ms"
              + ("; lengths unknown to the scheduler (no max_tokens, EOS)"
                 if cfg.lengths == "unknown" else ""))
        at = [r for r in rows if r["rps"] == spec.rps]
        print(format_table(at))
        classes = format_classes(at)
        if classes:
            print("\nper SLO class:\n" + classes)
        print("\nwhere the missed requests' time went (share of the missed seconds):\n"
              + format_misses(at))
        print("\nwhy running requests left the device (preemptions):\n"
              + format_preemptions(at))
    print(f"\n{len(tasks)} runs in {wall:.1f} s")

    config = {
        "hardware": hw.name,
        "model": model.name,
        "dataset": args.dataset,
        "rps": args.rps,
        "duration_s": None if args.num_prompts is not None else args.duration,
        "num_prompts": args.num_prompts,
        "burstiness": args.burstiness,
        "seed": args.seed,
        "max_prompt_len": args.max_prompt_len,
        "max_output_len": args.max_output_len,
        "length_scale": args.length_scale,
        "slo_classes": args.slo_classes,
        "policies": [v.label for v in variants],
        "sim": asdict(cfg),
        "wall_s": wall,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": config, "results": rows}, indent=1))
    if args.plot:
        rate_plot(rows, args.plot, f"{hw.name} + {model.name}, {args.dataset}, "
             f"SLO TTFT {cfg.ttft_slo:g} s / TBT {cfg.tbt_slo * 1000:g} ms")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from superinfer.sim.calibrate import calibrate

    out = Path(args.out) if args.out else None
    path = calibrate(out, quick=args.quick)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="superinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
