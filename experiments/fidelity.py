"""`python -m experiments fidelity`: the simulator against the real stack on the same workload.

    python -m experiments fidelity --experiment .experiments/policies/results.json \\
        --json fidelity.json --plot fidelity.png

Reads what `python -m experiments policies` wrote and, for every (policy, rate) it measured,
simulates the same thing on the `cpu-local` profile (this machine, `superinfer sim
calibrate`) with the bundled model's profile:

* the same trace: the WorkloadSpec `bench serve` built (dataset, rate, duration, seed,
  length limits, length_scale), checked request by request against the bench's own
  record (arrival, trace and server-counted prompt length, output length);
* the same engine: the EngineConfig that `serve` parsed from the experiment's flags
  (pools, max_num_seqs, max_batched_tokens, SLOs, policy parameters, serve_args), turned
  into a SimConfig with `SimConfig.from_engine`;
* the same metrics (superinfer/slo_metrics.py).

It prints real vs simulated TTFT and TBT attainment with their difference in points
(flagged beyond --threshold), P50/P99 TTFT, P50 TBT and rotations; then what each side
spent per iteration. Last, a diagnostic that says whether a gap comes from the cost model
(the machine ran slower or faster than calibrated) or from scheduling: the same simulation
with the execution cost scaled so that its mean execute time per iteration equals the one
the real run measured ("timing-matched"). Only the first comparison is the fidelity
result; the second uses the run's own timing and is not a prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.config import EngineConfig
from common.errors import SuperInferError
from superinfer.bench.server_stats import scheduler_stat
from superinfer.sim.engine import SimConfig, SimResult, SimulationError, Simulator
from superinfer.sim.plots import attainment_figure
from superinfer.sim.profile import HardwareProfile, ModelProfile, load_hardware, load_model
from superinfer.workload import SYNTHETIC, TraceRequest, WorkloadSpec, build_trace

THRESHOLD_POINTS = 10.0
ROW_KEYS = ("ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s",
            "p99_tbt_s", "rotations")


class FidelityError(SuperInferError):
    """The experiment file cannot be compared: missing, unreadable, or incomplete."""

    code = "invalid_experiment"
    http_status = 400


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", required=True, metavar="PATH",
                   help="results.json written by `python -m experiments policies`")
    p.add_argument("--hardware", default="cpu-local", help="hardware profile (name or .json)")
    p.add_argument("--model", default="smollm2-135m", help="model profile (the bundled model's)")
    p.add_argument("--threshold", type=float, default=THRESHOLD_POINTS,
                   help="flag differences in attainment beyond this many points")
    p.add_argument("--json", default=None, metavar="PATH", help="write the comparison")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="real vs simulated attainment vs rate, per policy")


# -- what the experiment ran ----------------------------------------------------------------
def load_experiment(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FidelityError(f"{p}: no such file (run `python -m experiments policies` first)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FidelityError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) \
            or not isinstance(data.get("results"), list) or not data["results"]:
        raise FidelityError(f"{p}: expected `python -m experiments policies` output: a 'config' object and "
                            "a non-empty 'results' list")
    need = ["dataset", "duration", "seed", "max_prompt_len", "max_output_len", "length_scale",
            "ttft_slo", "tbt_slo", "device_blocks", "host_blocks", "max_num_seqs"]
    missing = [k for k in need if k not in data["config"]]
    if missing:
        raise FidelityError(f"{p}: config lacks {', '.join(missing)}")
    if data["config"].get("bench_args"):
        # e.g. --no-ignore-eos --max-tokens 512: the model's EOS set the output lengths.
        raise FidelityError(
            f"{p}: its passes sent requests with --bench-args "
            f"{data['config']['bench_args']!r}; the simulator replays bench serve's default "
            "requests (the trace's output lengths, ignore_eos, completions), so the two are "
            "not comparable")
    return data


def workload_spec(config: dict[str, Any], rps: float) -> WorkloadSpec:
    """The spec `bench serve` built for one rate (superinfer/bench/serve/cli.py `_spec`)."""
    num = config.get("num_prompts")  # when set, bench serve sent exactly that many
    return WorkloadSpec(
        dataset=config["dataset"], rps=rps,
        duration_s=None if num is not None else float(config["duration"]),
        num_prompts=None if num is None else int(num),
        burstiness=float(config.get("burstiness", 1.0)), seed=int(config["seed"]),
        max_prompt_len=int(config["max_prompt_len"]),
        max_output_len=int(config["max_output_len"]),
        length_scale=float(config["length_scale"]),
    )


def engine_config(config: dict[str, Any], policy: str) -> tuple[EngineConfig, dict[str, Any]]:
    """The EngineConfig `serve` parsed for this policy, and the kvmem transfer settings."""
    from experiments.policies import engine_argv

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    EngineConfig.add_arguments(parser)
    parser.add_argument("--transfer-mode", default="duplex")  # kvmem's, via serve
    cfg = {"serve_args": "", **config}
    args, _ = parser.parse_known_args(engine_argv(policy, cfg))  # gateway/service flags
    try:
        ec = EngineConfig.from_args(args)
    except ValueError as e:
        raise FidelityError(f"the experiment's serve flags are invalid: {e}") from None
    mode = args.transfer_mode
    transfer = {"layout": "layer-first" if mode == "layer-first" else "block-first",
                "duplex": mode == "duplex"}
    return ec, transfer


def trace_for(config: dict[str, Any], rps: float) -> tuple[WorkloadSpec, list[TraceRequest]]:
    spec = workload_spec(config, rps)
    tokenizer = None
    if spec.dataset not in SYNTHETIC:
        # bench serve counts a dataset file's lengths with the bundled tokenizer ('auto').
        from superinfer.workload import length_counter

        tokenizer = length_counter("bundled")
    return spec, build_trace(spec, tokenizer)


def check_trace(trace: list[TraceRequest], per_request: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Is the simulated trace what the bench sent? Request by request, from its record."""
    if not per_request:
        return {"checked": False, "why": "the result has no per-request record"}
    by_index = {int(d["index"]): d for d in per_request}
    arrival = prompt = output = served_prompt = short = 0
    lag = 0.0
    for r in trace:
        d = by_index.get(r.index)
        if d is None:
            continue
        arrival += abs(float(d["scheduled_s"]) - r.arrival_s) > 1e-6
        prompt += int(d["trace_prompt_len"]) != r.prompt_len
        output += int(d["trace_output_len"]) != r.output_len
        if d.get("prompt_tokens") is not None:  # what the server counted (usage)
            served_prompt += int(d["prompt_tokens"]) != r.prompt_len
        if d.get("error") is None:
            short += int(d.get("output_tokens") or 0) != r.output_len
        if d.get("sent_s") is not None:
            lag = max(lag, float(d["sent_s"]) - float(d["scheduled_s"]))
    out = {
        "checked": True, "requests_sim": len(trace), "requests_bench": len(per_request),
        "arrival_mismatches": arrival, "prompt_len_mismatches": prompt,
        "output_len_mismatches": output, "server_prompt_token_mismatches": served_prompt,
        "completed_with_other_output_len": short, "max_send_lag_s": round(lag, 4),
    }
    out["identical"] = (len(trace) == len(per_request) and len(by_index) == len(trace)
                        and not (arrival or prompt or output or served_prompt))
    return out


# -- one comparison -------------------------------------------------------------------------
def real_batch_s(execute_s: float | None, execute_rpc_s: float | None,
                 executes: float | None, pipelined: bool) -> float | None:
    """The real stack's time per batch as the simulator counts its own (compute, with the
    RPC's overhead in the profile's intercept), from the scheduler's totals.

    Serial, that is the Execute RPC's wall time. Pipelined (the default), batch t+1's
    Execute is sent while t runs and queues in the worker behind it, so its wall time also
    holds most of t: about twice the batch (calibrated once: 196 ms of RPC wall time
    per batch against the worker's own 98 ms). There the worker's own time is the batch;
    the RPC's overhead, ~2 ms isolated, is left out."""
    if not executes:
        return None
    total = execute_s if pipelined else execute_rpc_s
    return None if total is None else total / executes


def _per_iteration(real: dict[str, Any], sim_stats: dict[str, Any],
                   pipelined: bool) -> dict[str, Any]:
    """Where each side spent its iterations (real: the server's metric deltas)."""
    m = (real.get("stats") or {}).get("server_metrics_delta") or {}

    def g(key: str) -> float | None:
        return scheduler_stat(m, key)

    executes, iters = g("executes"), g("iterations")
    ex, rpc, xfer, transfers = g("execute_s"), g("execute_rpc_s"), g("transfer_s"), g("transfers")
    eager = g("eager_blocks")
    sim_iters = int(sim_stats.get("iterations") or 0)
    return {
        "iterations_real": None if iters is None else int(iters),
        "iterations_sim": sim_iters,
        "mean_execute_s_real": real_batch_s(ex, rpc, executes, pipelined),
        "mean_worker_execute_s_real": ex / executes if ex is not None and executes else None,
        "mean_execute_rpc_overhead_s_real": (rpc - ex) / executes
        if rpc is not None and ex is not None and executes else None,
        "mean_execute_s_sim": mean_execute_s(sim_stats),
        "transfer_batches_real": None if transfers is None else int(transfers),
        "transfer_s_real": xfer,
        "transfer_s_sim": float(sim_stats.get("transfer_s") or 0.0),
        "eager_blocks_real": None if eager is None else int(eager),
        "eager_blocks_sim": sim_stats.get("eager_blocks"),
    }


def scaled_hardware(hw: HardwareProfile, k: float) -> HardwareProfile:
    """The profile with every execution cost k times longer (transfers unchanged)."""
    return dataclasses.replace(
        hw, peak_flops=hw.peak_flops / k, hbm_bandwidth_Bps=hw.hbm_bandwidth_Bps / k,
        attention_kv_Bps=None if hw.attention_kv_Bps is None else hw.attention_kv_Bps / k,
        iteration_overhead_s=hw.iteration_overhead_s * k)


def match_execute(hw: HardwareProfile, model: ModelProfile, policy: str, cfg: SimConfig,
                  trace: list[TraceRequest], duration_s: float | None, real_execute_s: float,
                  label: str | None = None) -> tuple[float, SimResult]:
    """The scale k for which `scaled_hardware(hw, k)` gives the real run's mean time per
    batch (the Execute call the scheduler waits for, RPC included), and that run's result."""
    k, res = 1.0, None
    for _ in range(4):  # the batch mix shifts with the timing: a few fixed-point steps
        res = Simulator(scaled_hardware(hw, k), model, policy, cfg, label=label).run(
            trace, duration_s)
        mean = mean_execute_s(res.stats)
        if not mean or abs(real_execute_s / mean - 1.0) < 0.01:
            break
        k *= real_execute_s / mean
    assert res is not None
    return k, res


def mean_execute_s(stats: dict[str, Any]) -> float | None:
    """The simulated time per batch: overhead (RPC included) plus the roofline."""
    n = int(stats.get("executes") or 0)
    return float(stats.get("execute_s") or 0.0) / n if n else None


def _timing_matched(hw: HardwareProfile, model: ModelProfile, policy: str, cfg: SimConfig,
                    label: str, trace: list[TraceRequest], spec: WorkloadSpec,
                    real_execute_s: float | None) -> dict[str, Any]:
    """Re-simulate with the execution cost scaled to the real run's mean execute time."""
    if not real_execute_s:
        return {"scale": None}
    from superinfer.sim.report import result_row

    k, res = match_execute(hw, model, policy, cfg, trace, spec.trace_duration_s,
                           real_execute_s, label)
    sim = result_row(spec.rps, res)
    return {"scale": round(k, 3), "ttft_attainment_sim": sim["ttft_attainment"],
            "tbt_attainment_sim": sim["tbt_attainment"],
            "mean_execute_s_sim": mean_execute_s(res.stats)}


def compare(
    data: dict[str, Any], hw: HardwareProfile, model: ModelProfile,
    threshold: float = THRESHOLD_POINTS,
) -> dict[str, Any]:
    """Simulate every (policy, rate) of the experiment; the side-by-side rows and checks."""
    from superinfer.sim.report import result_row

    config = data["config"]
    rows, configs = [], {}
    for real in data["results"]:
        policy, rps = str(real["policy"]), float(real["rps"])
        ec, transfer = engine_config(config, policy)  # a variant's label: its own flags
        cfg = SimConfig.from_engine(ec, **transfer)
        configs[policy] = asdict(cfg)
        spec, trace = trace_for(config, rps)
        result = Simulator(hw, model, ec.policy, cfg, label=policy).run(
            trace, spec.trace_duration_s)
        sim = result_row(rps, result)
        row: dict[str, Any] = {"policy": policy, "rps": rps}
        for k in ROW_KEYS:
            row[f"{k}_real"] = real.get(k)
            row[f"{k}_sim"] = sim.get(k)
        for k in ("ttft", "tbt"):
            a, b = real.get(f"{k}_attainment"), sim.get(f"{k}_attainment")
            row[f"{k}_diff_points"] = None if a is None or b is None else round(100 * (b - a), 1)
        row["flagged"] = [k for k in ("ttft", "tbt")
                          if row[f"{k}_diff_points"] is None
                          or abs(row[f"{k}_diff_points"]) > threshold]
        row["requests"] = len(trace)
        row["completed_real"], row["completed_sim"] = real.get("completed"), sim.get("completed")
        row["trace_check"] = check_trace(trace, real.get("per_request"))
        row["per_iteration"] = it = _per_iteration(real, result.stats, ec.pipeline)
        tm = _timing_matched(hw, model, ec.policy, cfg, policy, trace, spec,
                             it["mean_execute_s_real"])
        for k in ("ttft", "tbt"):
            a, b = real.get(f"{k}_attainment"), tm.get(f"{k}_attainment_sim")
            tm[f"{k}_diff_points"] = None if a is None or b is None else round(100 * (b - a), 1)
        row["timing_matched"] = tm
        rows.append(row)
    diffs = [abs(r[f"{k}_diff_points"]) for r in rows for k in ("ttft", "tbt")
             if r[f"{k}_diff_points"] is not None]
    return {
        "hardware": hw.name, "model": model.name,
        "hardware_calibration": (hw.sources or {}).get("iteration_overhead_s"),
        "experiment_machine": data.get("machine"), "experiment_command": data.get("command"),
        "threshold_points": threshold, "sim_config": configs, "rows": rows,
        "max_abs_diff_points": max(diffs) if diffs else None,
        "agree": bool(diffs) and all(not r["flagged"] for r in rows),
        "traces_identical": all(r["trace_check"].get("identical") for r in rows),
    }


# -- output ---------------------------------------------------------------------------------
def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}"


def _num(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _signed(v: Any) -> str:
    return "-" if v is None else f"{v:+.1f}"


def format_tables(report: dict[str, Any]) -> str:
    from superinfer.bench.report import table

    rows = report["rows"]
    main = table(
        ["policy", "RPS", "TTFT% real", "sim", "diff", "TBT% real", "sim", "diff",
         "p50 TTFT s real/sim", "p99 TTFT s real/sim", "p50 TBT s real/sim", "rotations real/sim",
         "flag"],
        [[r["policy"], f"{r['rps']:g}",
          _pct(r["ttft_attainment_real"]), _pct(r["ttft_attainment_sim"]),
          _signed(r["ttft_diff_points"]),
          _pct(r["tbt_attainment_real"]), _pct(r["tbt_attainment_sim"]),
          _signed(r["tbt_diff_points"]),
          f"{_num(r['p50_ttft_s_real'], '.2f')} / {_num(r['p50_ttft_s_sim'], '.2f')}",
          f"{_num(r['p99_ttft_s_real'], '.2f')} / {_num(r['p99_ttft_s_sim'], '.2f')}",
          f"{_num(r['p50_tbt_s_real'], '.3f')} / {_num(r['p50_tbt_s_sim'], '.3f')}",
          f"{_num(r['rotations_real'], 'd')} / {_num(r['rotations_sim'], 'd')}",
          ("> " + f"{report['threshold_points']:g} pts: " + ",".join(r["flagged"]))
          if r["flagged"] else ""]
         for r in rows])

    def ms(v: Any) -> str:
        return _num(None if v is None else 1000 * v, ".1f")

    it = table(
        ["policy", "RPS", "iterations real/sim", "execute ms/batch real/sim",
         "of which RPC", "transfer s real/sim", "eager blocks real/sim", "trace"],
        [[r["policy"], f"{r['rps']:g}",
          f"{_num(p['iterations_real'], 'd')} / {p['iterations_sim']}",
          f"{ms(p['mean_execute_s_real'])} / {ms(p['mean_execute_s_sim'])}",
          ms(p["mean_execute_rpc_overhead_s_real"]),
          f"{_num(p['transfer_s_real'], '.2f')} / {p['transfer_s_sim']:.2f}",
          f"{_num(p['eager_blocks_real'], 'd')} / {p['eager_blocks_sim']}",
          _trace_word(r["trace_check"])]
         for r in rows for p in [r["per_iteration"]]])
    tm = table(
        ["policy", "RPS", "execute scale", "TTFT% real", "sim", "diff", "TBT% real", "sim",
         "diff"],
        [[r["policy"], f"{r['rps']:g}", _num(t.get("scale"), ".2f"),
          _pct(r["ttft_attainment_real"]), _pct(t.get("ttft_attainment_sim")),
          _signed(t.get("ttft_diff_points")), _pct(r["tbt_attainment_real"]),
          _pct(t.get("tbt_attainment_sim")), _signed(t.get("tbt_diff_points"))]
         for r in rows for t in [r["timing_matched"]]])
    verdict = (f"max |diff| {report['max_abs_diff_points']:.1f} points: "
               + ("agree within" if report["agree"] else "NOT within")
               + f" {report['threshold_points']:g} points"
               if report["max_abs_diff_points"] is not None else "nothing to compare")
    return (f"{main}\n\n{it}\n\n{verdict}\n\ndiagnostic, not the fidelity result: the same "
            f"simulation with its execute time scaled to the real run's mean\n{tm}")


def _trace_word(c: dict[str, Any]) -> str:
    if not c.get("checked"):
        return "not checked"
    if c["identical"]:
        return f"identical ({c['requests_sim']} requests)"
    return (f"DIFFERS: {c['arrival_mismatches']} arrivals, {c['prompt_len_mismatches']}/"
            f"{c['server_prompt_token_mismatches']} prompt (trace/server), "
            f"{c['output_len_mismatches']} output; {c['requests_bench']} vs {c['requests_sim']}")


def plot(report: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    rows = report["rows"]
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]

    def draw(ax: Any, key: str) -> None:
        for j, label in enumerate(labels):
            mine = sorted((r for r in rows if r["policy"] == label), key=lambda r: r["rps"])
            for side, style, marker in (("real", "-", "o"), ("sim", "--", "x")):
                pts = [(r["rps"], 100 * r[f"{key}_{side}"]) for r in mine
                       if r[f"{key}_{side}"] is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], linestyle=style,
                        marker=marker, color=colours[j % len(colours)], label=f"{label} ({side})")

    attainment_figure(path, title, draw, legend_size=7)


def run(args: argparse.Namespace) -> int:
    try:
        data = load_experiment(args.experiment)
        hw, model = load_hardware(args.hardware), load_model(args.model)
        report = compare(data, hw, model, args.threshold)
    except (SuperInferError, SimulationError) as e:
        print(f"python -m experiments fidelity: error: {e}", file=sys.stderr)
        return 2
    report["experiment"] = str(args.experiment)
    print(f"{args.experiment}: real stack vs `superinfer sim` ({hw.name} + {model.name})")
    print(f"profile: {report['hardware_calibration']}")
    print(format_tables(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot, f"real stack (solid) vs simulator on {hw.name} (dashed)")
        print(f"wrote {args.plot}")
    return 0
