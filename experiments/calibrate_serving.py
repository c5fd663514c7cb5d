"""`python -m experiments calibrate-serving`: `superinfer sim calibrate`, then the worker's
slowdown inside the whole serving stack, measured and applied to the profile.

Inside `serve` the worker shares the cores with the scheduler, the gateway streaming
tokens and the client, and its batches run slower than alone (1.4-2x on 2 cores). A short
policy run (lvf, `--rate`, 30 s, its own seed 12345) drives the whole stack; the simulator
replays that run, and every execution term of the profile is scaled by the one factor that
makes the simulated mean time per batch equal the mean Execute time the scheduler
measured. The run also gives the stack's own cost per transfer batch. It uses one
policy's mean batch time, never attainment. The rate is the load the comparisons run at:
the more streams the gateway and the client serve, the more of the cores they take.
Measured with an earlier executor: 30 s at 1.5x saturation (121 requests) gave a factor of
1.35, and a four-policy pass run right after replayed within 8 TTFT points; shorter or
lighter runs gave 1.03-1.12 and replays off by up to 17 points.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from superinfer.argtypes import rate
from superinfer.bench.server_stats import scheduler_stat
from superinfer.sim.calibrate import calibrate
from superinfer.sim.engine import SimConfig, Simulator
from superinfer.sim.profile import load_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help="where to write the profile (default: the bundled cpu-local.json)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a rough profile)")
    p.add_argument("--rate", type=rate, default=SERVING_RATE, metavar="RPS",
                   help="the serving run's request rate (default %(default)s: 1.5x the "
                        "saturation rate measured here)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    path = calibrate(out, quick=args.quick,
                     serving=lambda hw, timeout: measure_serving(hw, timeout, args.rate))
    print(f"wrote {path}")
    return 0


SERVING_RATE = 4.32  # req/s of the serving run: 1.5x this machine's saturation (module doc)
SERVING_DURATION_S = 30  # long enough for the batches of a backlog, not only its start


def serving_run(rate: float) -> list[str]:
    return ["--policies", "lvf", "--rates", f"{rate:g}", "--duration", str(SERVING_DURATION_S),
            "--seed", "12345"]


def measure_serving(hw_isolated: Any, timeout_s: float,
                    rate: float = SERVING_RATE) -> dict[str, Any]:
    """How much slower the worker runs inside the serving stack than alone.

    A short `python -m experiments policies` run (its own seed, not the experiments' default)
    runs the whole stack; the simulator replays that run on the isolated profile and the
    execution cost is scaled until its mean time per batch equals the one the scheduler
    measured (`fidelity.real_batch_s`: the worker's own time when pipelined, the Execute
    RPC's wall time when serial). Also the stack's own per-batch transfer cost.
    """
    import subprocess

    from experiments import fidelity

    run = serving_run(rate)
    with tempfile.TemporaryDirectory(prefix="superinfer-calibrate-serve-") as d:
        argv = [sys.executable, "-m", "experiments", "policies", *run,
                "--out", d, "--startup-timeout", str(timeout_s)]
        print("calibrate: serving run (`python -m experiments policies "
              + " ".join(run) + "`) …", file=sys.stderr, flush=True)
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the serving run failed ({done.returncode}):\n"
                               + done.stdout[-2000:])
        data = fidelity.load_experiment(Path(d) / "results.json")
    config, real = data["config"], data["results"][0]
    m = real["stats"]["server_metrics_delta"]

    def g(key: str) -> float:
        return scheduler_stat(m, key) or 0.0

    executes = g("executes")
    if not executes:
        raise RuntimeError("the serving run executed no batch")
    ec, transfer = fidelity.engine_config(config, real["policy"])
    real_mean = fidelity.real_batch_s(g("execute_s"), g("execute_rpc_s"), executes,
                                      ec.pipeline)
    assert real_mean is not None
    cfg = SimConfig.from_engine(ec, **transfer)
    spec, trace = fidelity.trace_for(config, float(real["rps"]))
    k, res = fidelity.match_execute(hw_isolated, load_model("smollm2-135m"), ec.policy, cfg,
                                    trace, spec.trace_duration_s, real_mean)
    transfers = g("transfers")
    plan = ((g("transfer_s") - max(g("kvmem_d2h_s"), g("kvmem_h2d_s"))) / transfers
            if transfers else None)
    return {
        "command": "python -m experiments policies " + " ".join(run),
        "requests": real.get("requests"), "executes": int(executes),
        "mean_batch_s": real_mean, "pipelined": ec.pipeline,
        "mean_execute_rpc_s": g("execute_rpc_s") / executes,
        "mean_worker_execute_s": g("execute_s") / executes,
        "execute_rpc_overhead_s": (g("execute_rpc_s") - g("execute_s")) / executes,
        "transfers": int(transfers), "plan_overhead_s": plan,
        "slowdown": k, "load_average_at_start": data["machine"].get("load_average_at_start"),
        "sim_mean_execute_s_isolated_profile": fidelity.mean_execute_s(
            Simulator(hw_isolated, load_model("smollm2-135m"), ec.policy, cfg).run(
                trace, spec.trace_duration_s).stats),
        "sim_mean_execute_s_scaled": fidelity.mean_execute_s(res.stats),
    }
