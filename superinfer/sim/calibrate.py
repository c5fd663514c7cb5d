"""`superinfer sim calibrate`: measure this machine and write the `cpu-local` profile.

`cpu-local` stands for the real stack on this machine (`superinfer serve`), so every number
comes from the services themselves: calibrate starts a worker and a kvmem the way `serve`
does (same code, same threads, kvmem's own glibc tunables) and talks to them over gRPC.

* Iterations: Execute RPCs of hand-built batches in the range a small device pool sees
  (prefill chunks of 16-512 tokens, decode batches of 1-16 with 64-512 tokens of context,
  prefill and decode mixed). The worker reports its own time for each (`execute_s`, the
  runner's forward pass and sampling). `t = c0 + max(FLOPs/F, weights/B) + KV/A`
  (superinfer/sim/cost.py) is fitted to all points at once, minimising the squared
  relative error; the profile keeps every
  point's measured and modelled time. The RPC's wall time minus `execute_s` is the cost
  of the process split, paid every iteration: it is added to the fixed overhead.
* Transfers: Transfer RPCs to kvmem in duplex mode (`serve`'s default) on the bundled
  model's real blocks. One-direction plans of coalesced runs of k blocks give the
  bandwidth curve (segment = k blocks; kvmem's own copy time, per-call cost removed);
  equal swap-outs and swap-ins at once give the duplex limit; one-block plans give the
  fixed cost of a transfer batch (RPC wall time minus the copy). A kvmem in layer-first
  mode gives the small-segment point (one layer's K or V of one block), and one in
  block-first mode (one lane) checks the half-duplex model (D2H + H2D).
* Alone, the worker runs faster than inside the whole stack, where it shares the cores
  with the scheduler, the gateway and the client. `python -m experiments calibrate-serving`
  (the experiments folder of a checkout) runs this calibration and then scales the profile
  by that slowdown, measured on a short serving run.

It takes about three and a half minutes on an idle 2-core machine. Timings on a shared
machine measure the neighbours too: the fastest of the repetitions is kept, and the load
average at start and end is written into the profile. Calibrate under the conditions the
comparison will run in.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.daemon import free_port
from superinfer.sim.profile import PROFILE_DIR, HardwareProfile, load_hardware, load_model

GIB = 1 << 30
DEVICE_BLOCKS = 512  # the calibration worker's pool (block tables of every case fit)
HOST_BLOCKS = 512
RUN_LENGTHS = [1, 4, 16, 64, 128]  # blocks per coalesced run -> segment sizes of the curve
CASES: list[tuple[str, list[tuple[int, int]]]] = [  # (name, [(start_pos, tokens)] per chunk)
    ("prefill-16", [(0, 16)]),
    ("prefill-64", [(0, 64)]),
    ("prefill-128", [(0, 128)]),
    ("prefill-256", [(0, 256)]),
    ("prefill-512", [(0, 512)]),
    ("prefill-128@256", [(256, 128)]),
    ("prefill-64@512", [(512, 64)]),
    ("decode-1x64", [(64, 1)]),
    ("decode-2x64", [(64, 1)] * 2),
    ("decode-4x64", [(64, 1)] * 4),
    ("decode-8x64", [(64, 1)] * 8),
    ("decode-16x64", [(64, 1)] * 16),
    ("decode-1x512", [(512, 1)]),
    ("decode-4x240", [(240, 1)] * 4),
    ("decode-8x128", [(128, 1)] * 8),
    ("mixed-4x64+16", [(64, 1)] * 4 + [(0, 16)]),
    ("mixed-4x64+32", [(64, 1)] * 4 + [(0, 32)]),
    ("mixed-4x64+128", [(64, 1)] * 4 + [(0, 128)]),
    ("mixed-6x150+64", [(150, 1)] * 6 + [(0, 64)]),
    ("mixed-8x64+256", [(64, 1)] * 8 + [(0, 256)]),
]




# -- iterations ---------------------------------------------------------------------------------
def _chunks(spec: list[tuple[int, int]], block_size: int) -> list[Any]:
    from common.contracts import ScheduledChunk

    out, next_block = [], 0
    for i, (start, n) in enumerate(spec):
        k = -(-(start + n) // block_size)
        out.append(ScheduledChunk(f"c{i}", [7] * n, start, list(range(next_block, next_block + k)),
                                  sample=True, temperature=0.0))
        next_block += k
    return out


async def measure_iterations(worker: Any, pool_id: str, block_size: int,
                             reps: int) -> tuple[list[dict[str, Any]], list[float]]:
    """Each case's fastest worker-side time, and every call's RPC overhead (wall - execute_s).

    The repetitions go round the cases (a warm-up round first), so a burst of load from a
    neighbour spoils one repetition of several cases rather than every repetition of one.
    """
    batches = [_chunks(spec, block_size) for _, spec in CASES]
    best = [math.inf] * len(CASES)
    rpc: list[float] = []
    iteration = 0
    for r in range(reps + 1):
        for i, chunks in enumerate(batches):
            iteration += 1
            t0 = time.perf_counter()
            res = await worker.execute(iteration, chunks, pool_id)
            wall = time.perf_counter() - t0
            if r:
                best[i] = min(best[i], res.execute_s)
                rpc.append(wall - res.execute_s)
    points = [{"case": name, "chunks": spec, "seconds": t}
              for (name, spec), t in zip(CASES, best, strict=True)]
    return points, rpc


def _counts(spec: list[tuple[int, int]]) -> tuple[float, float, float]:
    """(FLOPs, weight bytes, KV bytes) of a batch, as ExecutionCostModel counts them."""
    from superinfer.sim.cost import ExecutionCostModel

    probe = ExecutionCostModel(load_hardware("gh200"), load_model("smollm2-135m"))
    tokens = sum(n for _, n in spec)
    pairs = sum(n * s + n * (n + 1) // 2 for s, n in spec)
    context = sum(s + n for s, n in spec)
    flops = (probe.linear_flops_per_token * tokens + probe.lm_head_flops * len(spec)
             + probe.attn_flops_per_pair * pairs)
    return flops, probe.weight_bytes_read(tokens), probe.kv_bytes_per_token * context


def fit_iterations(points: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(c0, F, B, A) of t = c0 + max(FLOPs/F, weights/B) + KV/A (superinfer/sim/cost.py).

    Least squares on relative error: a log grid over F and B, the intercept and 1/A in
    closed form for each pair (both kept >= 0), then a finer grid around the best pair.
    Fills in every point's modelled time and relative error.
    """
    counts = [_counts(p["chunks"]) for p in points]
    ts = [p["seconds"] for p in points]
    w = [1.0 / t**2 for t in ts]
    kv = [k for _, _, k in counts]

    def solve(F: float, B: float) -> tuple[float, float, float]:
        r = [t - max(f / F, b / B) for t, (f, b, _) in zip(ts, counts)]
        sw, sk, skk = sum(w), sum(wi * k for wi, k in zip(w, kv)), sum(
            wi * k * k for wi, k in zip(w, kv))
        sr, skr = sum(wi * ri for wi, ri in zip(w, r)), sum(
            wi * k * ri for wi, k, ri in zip(w, kv, r))
        det = sw * skk - sk * sk
        c0, x = ((skk * sr - sk * skr) / det, (sw * skr - sk * sr) / det) if det else (0.0, 0.0)
        if x < 0:
            c0, x = sr / sw, 0.0
        if c0 < 0:
            c0, x = 0.0, max(0.0, skr / skk) if skk else 0.0
        err = sum(wi * (c0 + x * k - ri) ** 2 for wi, k, ri in zip(w, kv, r))
        return err, c0, x

    def grid(lo_f: float, hi_f: float, lo_b: float, hi_b: float,
             n: int) -> tuple[float, float, float, float]:
        best = (math.inf, 0.0, 0.0, 0.0, 0.0)
        for i in range(n):
            F = lo_f * (hi_f / lo_f) ** (i / (n - 1))
            for j in range(n):
                B = lo_b * (hi_b / lo_b) ** (j / (n - 1))
                err, c0, x = solve(F, B)
                if err < best[0]:
                    best = (err, c0, F, B, x)
        return best[1], best[2], best[3], best[4]

    _, F, B, _ = grid(1e9, 1e13, 1e8, 1e12, 49)
    c0, F, B, x = grid(F / 1.25, F * 1.25, B / 1.25, B * 1.25, 31)
    A = 1.0 / x if x > 0 else 1e15  # no measurable KV pass
    for p, (f, b, k) in zip(points, counts):
        p["modelled_seconds"] = c0 + max(f / F, b / B) + k / A
        p["error"] = round(p["modelled_seconds"] / p["seconds"] - 1.0, 4)
    return c0, F, B, A


# -- transfers ----------------------------------------------------------------------------------
def _runs(k: int, total_blocks: int, offset: int = 0) -> list[tuple[int, int]]:
    """(src, dst) pairs: runs of k consecutive blocks, one block apart so runs never merge."""
    m = max(1, total_blocks // k)
    return [(offset + j * (k + 1) + i, offset + j * (k + 1) + i) for j in range(m) for i in range(k)]


def memmove_call_s() -> float:
    """Per-call cost of kvmem's CPU copy (a ctypes memmove) on a tiny copy."""
    a, b = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            ctypes.memmove(a, b, 64)
        best = min(best, (time.perf_counter() - t0) / 2000)
    return best


class _Fence:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


async def measure_duplex(kvmem: Any, pool_id: str, block_bytes: int, reps: int,
                         launch_s: float, fence: _Fence) -> dict[str, Any]:
    from common.contracts import TransferPlan

    async def fastest(swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> Any:
        best = None
        for r in range(reps + 1):  # the first pass faults the pages in
            reply = await kvmem.transfer(TransferPlan(fence(), swap_out=swap_out,
                                                      swap_in=swap_in), pool_id)
            if r and (best is None or reply.total_s < best.total_s):
                best = reply
        return best

    curve = []
    for k in RUN_LENGTHS:
        pairs = _runs(k, 128)  # ~90 MiB per plan with the bundled model's 0.7 MiB blocks
        reply = await fastest(pairs, [])
        runs = len(pairs) // k
        seg = k * block_bytes
        per_run = reply.d2h_s / runs
        curve.append([seg, float(f"{seg / max(per_run - launch_s, per_run * 0.05):.4g}")])
    # Both directions at once: 128 blocks out while 128 others come in.
    out_pairs = _runs(16, 128)
    in_pairs = _runs(16, 128, offset=256)
    both = await fastest(out_pairs, in_pairs)
    duplex_Bps = (len(out_pairs) + len(in_pairs)) * block_bytes / both.total_s
    # One block: what a transfer batch costs beyond its copies.
    fixed = []
    for _ in range(max(5, 4 * reps)):
        t0 = time.perf_counter()
        reply = await kvmem.transfer(TransferPlan(fence(), eager=[(300, 300)]), pool_id)
        wall = time.perf_counter() - t0
        fixed.append(wall - reply.d2h_s)
    return {"curve": curve, "duplex_total_Bps": float(f"{duplex_Bps:.4g}"),
            "duplex_plan": {"blocks_each_way": len(out_pairs), "d2h_s": both.d2h_s,
                            "h2d_s": both.h2d_s, "total_s": both.total_s},
            "plan_overhead_s": statistics.median(fixed), "plan_overhead_samples_s": fixed}


async def measure_half(kvmem: Any, pool_id: str, reps: int, fence: _Fence) -> dict[str, Any]:
    """block-first (one lane): the same two-way plan; the model says d2h + h2d."""
    from common.contracts import TransferPlan

    out_pairs, in_pairs = _runs(16, 128), _runs(16, 128, offset=256)
    replies = [await kvmem.transfer(TransferPlan(fence(), swap_out=out_pairs, swap_in=in_pairs),
                                    pool_id) for _ in range(reps + 1)]
    best = min(replies[1:], key=lambda r: r.total_s)
    return {"d2h_s": best.d2h_s, "h2d_s": best.h2d_s, "total_s": best.total_s,
            "sum_of_directions_s": best.d2h_s + best.h2d_s}


async def measure_layer_first(kvmem: Any, pool_id: str, reps: int, layers: int,
                              block_bytes: int, launch_s: float, fence: _Fence) -> list[float]:
    """[segment bytes, bytes/s] of one layer's K or V of a block, copied one by one."""
    from common.contracts import TransferPlan

    pairs = _runs(1, 64)
    best = math.inf
    for r in range(reps + 1):
        reply = await kvmem.transfer(TransferPlan(fence(), swap_out=pairs), pool_id)
        if r:
            best = min(best, reply.d2h_s)
    seg = block_bytes // (2 * layers)
    per_seg = best / (len(pairs) * 2 * layers)
    return [seg, float(f"{seg / max(per_seg - launch_s, per_seg * 0.05):.4g}")]


# -- the services -------------------------------------------------------------------------------
class _Services:
    """Services started as `serve` starts them, each stoppable on its own."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.running: dict[str, Any] = {}  # name -> its Supervisor

    def start(self, name: str, argv: list[str]) -> str:
        from superinfer.probes import grpc_probe
        from superinfer.supervisor import ServiceSpec, Supervisor

        port = free_port()
        addr = f"127.0.0.1:{port}"
        print(f"calibrate: starting {name} …", file=sys.stderr, flush=True)
        sup = self.running[name] = Supervisor(self.run_dir)
        sup.start(ServiceSpec(name, [sys.executable, "-m", "superinfer.cli", argv[0],
                                     "--run-dir", str(self.run_dir), "--host", "127.0.0.1",
                                     "--port", str(port), *argv[1:]], grpc_probe(addr)),
                  self.timeout_s)
        return addr

    def stop(self, name: str) -> None:
        sup = self.running.pop(name, None)
        if sup is not None:
            sup.stop_all()

    def stop_all(self) -> None:
        for name in reversed(list(self.running)):
            self.stop(name)


async def _measure(quick: bool, timeout_s: float) -> dict[str, Any]:
    from scheduler_svc.remote import RemoteKVMem, RemoteWorker

    reps = 2 if quick else 5
    launch_s = memmove_call_s()
    tmp = tempfile.TemporaryDirectory(prefix="superinfer-calibrate-")
    svc = _Services(Path(tmp.name), timeout_s)
    fence = _Fence()
    try:
        waddr = svc.start("worker", ["worker", "--device-blocks", str(DEVICE_BLOCKS)])
        worker = RemoteWorker(waddr)
        handle = await worker.kv_pool()
        info = await worker.model_info()
        block_size = int(handle.shape[3])
        layers = int(handle.shape[1])
        print("calibrate: iterations …", file=sys.stderr, flush=True)
        points, rpc = await measure_iterations(worker, handle.pool_id, block_size, reps)
        # What `--dtype auto` chose here: the weights' format and the KV pool's dtype.
        out: dict[str, Any] = {"iterations": points, "execute_rpc_overhead_s": rpc,
                               "executor_format": info.dtype, "kv_dtype": handle.dtype,
                               "block_size": block_size}
        for mode in ("duplex", "block-first", "layer-first"):
            kaddr = svc.start(f"kvmem-{mode}", ["kvmem", "--host-blocks", str(HOST_BLOCKS),
                                                "--transfer-mode", mode])
            kvmem = RemoteKVMem(kaddr)
            try:
                await kvmem.attach(handle)
                block_bytes = out["block_bytes"] = int(handle.nbytes) // int(handle.shape[0])
                print(f"calibrate: transfers ({mode}) …", file=sys.stderr, flush=True)
                if mode == "duplex":
                    out["duplex"] = await measure_duplex(kvmem, handle.pool_id, block_bytes,
                                                         reps, launch_s, fence)
                elif mode == "block-first":
                    out["block_first"] = await measure_half(kvmem, handle.pool_id, reps, fence)
                else:
                    out["layer_first_point"] = await measure_layer_first(
                        kvmem, handle.pool_id, reps, layers, block_bytes, launch_s, fence)
            finally:
                await kvmem.close()
                svc.stop(f"kvmem-{mode}")
        await worker.close()
        out["launch_s"] = launch_s
        return out
    finally:
        svc.stop_all()
        tmp.cleanup()


def _threads() -> str:
    return os.environ.get("OMP_NUM_THREADS") or f"torch default ({os.cpu_count()} CPUs)"


def warn_block_bytes(pool_block_bytes: int, block_size: int, kv_dtype: str) -> bool:
    """Does the model profile count a KV block as the worker's pool holds it? If not, say
    so (the fit and every simulated transfer would count the wrong bytes) and what to do."""
    model = load_model("smollm2-135m")
    modelled = model.block_bytes(block_size)
    if modelled == pool_block_bytes:
        return True
    print(f"calibrate: warning: the smollm2-135m model profile counts a {block_size}-token KV "
          f"block as {modelled:,} bytes, the worker's pool ({kv_dtype}) holds {pool_block_bytes:,}"
          f"; set kv_dtype_bytes in superinfer/sim/profiles/models/smollm2-135m.json to "
          f"{pool_block_bytes * model.kv_element_bytes / modelled:g} (or the simulator moves "
          f"{modelled / pool_block_bytes:g}x the bytes per block)", file=sys.stderr)
    return False


def calibrate(out: Path | None = None, quick: bool = False, timeout_s: float = 300.0,
              serving: Callable[[HardwareProfile, float], dict[str, Any]] | None = None) -> Path:
    """Measure this machine and write the profile. `serving`, where given, measures the
    worker's slowdown inside the whole stack against the isolated profile (the
    experiments folder's `calibrate-serving` does); the profile is scaled by it."""
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t0 = time.monotonic()
    m = asyncio.run(_measure(quick, timeout_s))
    warn_block_bytes(m["block_bytes"], m["block_size"], m["kv_dtype"])
    points = m["iterations"]
    c0, flops, bw, attn_bw = fit_iterations(points)
    rpc = statistics.median(m["execute_rpc_overhead_s"])
    dup = m["duplex"]
    curve = sorted([m["layer_first_point"], *dup["curve"]])
    errors = [abs(p["error"]) for p in points]
    here = (f"measured here by `superinfer sim calibrate` at {started} UTC ({platform.machine()}, "
            f"{os.cpu_count()} CPUs, worker threads: {_threads()}, load average "
            f"{load_start[0]:.1f} at start)")
    profile: dict[str, Any] = {
        "name": "cpu-local",
        "description": "this machine's CPU running `superinfer serve`: the device pool is a "
                       "shared-memory pool in DRAM, the bundled SmolLM2-135M runs in the "
                       f"worker process ({m['executor_format']} weights, {m['kv_dtype']} KV: "
                       "what `--dtype auto` chose), kvmem copies blocks with DuplexKV's CPU "
                       "lanes",
        "peak_flops": flops,
        "mfu": 1.0,
        "hbm_bandwidth_Bps": bw,
        "hbm_efficiency": 1.0,
        "attention_kv_Bps": attn_bw,
        "iteration_overhead_s": c0 + rpc,
        "device_kv_bytes": 0.5 * GIB,
        "host_kv_bytes": 2.0 * GIB,
        "link": {
            "name": "DRAM memcpy (kvmem DuplexKV CPU lanes)",
            "d2h_curve": curve,
            "h2d_curve": curve,
            "duplex_total_Bps": dup["duplex_total_Bps"],
            "launch_overhead_s": float(f"{m['launch_s']:.3g}"),
            "batched_launch_overhead_s": float(f"{m['launch_s']:.3g}"),
            "plan_overhead_s": dup["plan_overhead_s"],
        },
        "calibration": {
            "started_utc": started,
            "load_average_start": [round(x, 2) for x in load_start],
            "worker_threads": _threads(),
            "executor_format": m["executor_format"],
            "kv_dtype": m["kv_dtype"],
            "isolated_fit": {"worker_intercept_s": c0, "execute_rpc_overhead_s": rpc,
                             "peak_flops": flops, "hbm_bandwidth_Bps": bw,
                             "attention_kv_Bps": attn_bw, "plan_overhead_s": dup["plan_overhead_s"],
                             "median_abs_error": statistics.median(errors),
                             "max_abs_error": max(errors)},
            "iterations": points,
            "block_bytes": m["block_bytes"],
            "duplex_plan": dup["duplex_plan"],
            "block_first_plan": m["block_first"],
            "plan_overhead_samples_s": dup["plan_overhead_samples_s"],
        },
        "sources": {
            "peak_flops": f"{here}: fitted with hbm_bandwidth_Bps, attention_kv_Bps and the "
                          f"intercept to the worker's own time of {len(points)} batches, run "
                          "alone (calibration.iterations)",
            "mfu": "1: peak_flops is already the achieved rate",
            "hbm_bandwidth_Bps": f"{here}: the same fit (weight streaming, the memory side "
                                 "of the roofline)",
            "attention_kv_Bps": f"{here}: the same fit (the rate at which attention reads the "
                                "KV context, a pass added to the roofline)",
            "hbm_efficiency": "1: hbm_bandwidth_Bps is already the achieved rate",
            "iteration_overhead_s": f"{here}: the fit's intercept plus the median Execute RPC "
                                    "overhead (RPC wall time minus the worker's execute_s)",
            "device_kv_bytes": "EngineConfig default kv_memory_gib = 0.5",
            "host_kv_bytes": "EngineConfig default host_memory_gib = 2.0",
            "link.d2h_curve": f"{here}: kvmem Transfer RPCs (duplex mode), swap-outs in runs of "
                              f"{RUN_LENGTHS} blocks, kvmem's copy time per run minus the "
                              "per-call cost; the smallest point from a layer-first kvmem",
            "link.h2d_curve": "same as d2h: both pools are DRAM",
            "link.duplex_total_Bps": f"{here}: 128 blocks out and 128 in, one plan, duplex "
                                     "kvmem: both byte counts over kvmem's total time",
            "link.launch_overhead_s": f"{here}: per-call cost of a 64-byte ctypes memmove",
            "link.batched_launch_overhead_s": "no batched copy call on a CPU: same per-call cost",
            "link.plan_overhead_s": f"{here}: median of one-block Transfer RPCs' wall time "
                                    "minus kvmem's copy time",
        },
    }
    path = out or PROFILE_DIR / "hardware" / "cpu-local.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if serving:
        with tempfile.TemporaryDirectory() as d:
            iso = Path(d) / "cpu-local-isolated.json"
            iso.write_text(json.dumps(profile))
            srv = serving(load_hardware(str(iso)), timeout_s)
        apply_serving(profile, srv, started)
    profile["calibration"]["wall_s"] = round(time.monotonic() - t0, 1)
    profile["calibration"]["load_average_end"] = [
        round(x, 2) for x in (os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3)]
    for key in ("peak_flops", "hbm_bandwidth_Bps", "attention_kv_Bps", "iteration_overhead_s"):
        profile[key] = float(f"{profile[key]:.4g}")
    profile["link"]["plan_overhead_s"] = float(f"{profile['link']['plan_overhead_s']:.4g}")
    path.write_text(json.dumps(profile, indent=2) + "\n")
    load_hardware(str(path))  # the file must load
    return path


def apply_serving(profile: dict[str, Any], srv: dict[str, Any], started: str) -> None:
    """Scale the execution cost by the in-stack slowdown; the stack's own batch cost."""
    k = srv["slowdown"]
    profile["calibration"]["serving"] = srv
    profile["peak_flops"] /= k
    profile["hbm_bandwidth_Bps"] /= k
    profile["attention_kv_Bps"] /= k
    profile["iteration_overhead_s"] *= k
    why = (f", then every execution term scaled by {k:.3f}: the worker's slowdown inside the "
           f"serving stack, measured by the same calibration ({started} UTC) with `"
           f"{srv['command']}`: the simulator's replay of that run matches the scheduler's "
           f"mean time per batch of {1000 * srv['mean_batch_s']:.1f} ms "
           "(calibration.serving; fidelity.real_batch_s)")
    src = profile["sources"]
    for key in ("peak_flops", "hbm_bandwidth_Bps", "attention_kv_Bps", "iteration_overhead_s"):
        src[key] += why
    if srv["plan_overhead_s"] is not None and srv["transfers"] >= 5:
        profile["link"]["plan_overhead_s"] = srv["plan_overhead_s"]
        src["link.plan_overhead_s"] = (
            f"measured in the serving run of the calibration at {started} UTC (`"
            f"{srv['command']}`): the scheduler's Transfer wall time minus kvmem's copy time, "
            f"per batch, over {srv['transfers']} batches")
