"""`superinfer bench transfer`: DuplexKV's modes against one raw copy, same bytes, same run.

For two KV shapes — Qwen2.5-32B (64 layers, 8 KV heads, head_dim 128, bf16, block 16:
one layer's K or V of a block is 16*8*128*2 = 32 KiB, K+V 64 KiB, a block 4 MiB) and the
bundled SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32, block 16: 12 KiB, 24 KiB,
720 KiB) — one plan moves the same random, scattered blocks with every mode: half of them
device->host (a quarter of those as eager copies), half host->device. GB/s counts the
bytes moved both ways over the wall time of `transfer(plan)`. `raw_gbps` is one contiguous
memmove of the same byte count, the most this machine's memory moves per second; ratios
are taken within each repeat, the modes in a shuffled order, because on a shared CPU the
absolute numbers drift from second to second.

Pools hold twice the blocks moved (so ids scatter) and are pre-faulted before timing.

`--device cuda` (UNTESTED here: no GPU on the machine this was written on) puts the device
pool in GPU memory and page-locks the host pool; `raw_gbps` is then one large
device->host copy plus one large host->device copy of the plan's byte split, one after the
other (the link's one-way bandwidth, per direction in `raw_d2h_gbps`/`raw_h2d_gbps`), so
block-first's ratio to it is the goal "≥ 90 % of one-way bandwidth" and duplex's ratio
to block-first its "≥ 1.7x one direction".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from common.contracts import TransferPlan
from kvmem_svc.duplex import DuplexEngine, Mode
from kvmem_svc.hostmem import allocate_host_pool
from kvmem_svc.tunables import NT_KEY, NT_THRESHOLD, nt_threshold_in_effect, with_nt_threshold
from superinfer.bench.report import table, write_json

MODES = [Mode.LAYER_FIRST, Mode.BLOCK_FIRST, Mode.DUPLEX]
VARIANTS: dict[str, tuple[Mode, str]] = {m.value: (m, "auto") for m in MODES}
# --copy-rows: the same modes with `Tensor.copy_` per copy instead of memmove (slow: block
# copies of a few MiB on two OpenMP threads crawl on a busy machine, see kvmem_svc/cpu_copy.py).
COPY_VARIANTS: dict[str, tuple[Mode, str]] = {
    "layer-first/copy_": (Mode.LAYER_FIRST, "torch"),
    "block-first/copy_": (Mode.BLOCK_FIRST, "torch"),
}


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    default_blocks: int = 128

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def segment_bytes(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * torch.empty(
            0, dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.segment_bytes * 2 * self.num_layers


# Default block counts move 384 MiB per plan for both shapes: more than glibc's default
# non-temporal threshold (~114 MiB here), so the raw copy is the fastest kind of memmove.
SHAPES = [
    Shape("qwen2.5-32b", 64, 8, 128, torch.bfloat16, default_blocks=96),
    Shape("smollm2-135m", 30, 3, 64, torch.float32, default_blocks=546),
    # Llama-3-8B's KV, 2 MiB blocks: the GPU check's second shape (not in the default run).
    Shape("llama-3-8b", 32, 8, 128, torch.bfloat16, default_blocks=192),
]
DEFAULT_SHAPES = "qwen2.5-32b,smollm2-135m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None,
                   help="blocks moved per plan (default: ~512 MiB worth per shape)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of every mode")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"of {', '.join(s.name for s in SHAPES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nt-threshold", default=NT_THRESHOLD, metavar="BYTES",
                   help=f"measure with GLIBC_TUNABLES={NT_KEY}=BYTES (in a child process): "
                        f"default {NT_THRESHOLD}, what the kvmem daemon runs with (block "
                        "copies then use non-temporal stores, as a large memmove does); "
                        "'default' keeps glibc's own threshold")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the device pool lives: cpu (both pools in DRAM) or cuda (GPU "
                        "memory, host pool page-locked)")
    p.add_argument("--copy-rows", action="store_true",
                   help="also time layer-first and block-first with torch copy_ (slow)")
    p.add_argument("--json", default=None, help="write results to this JSON file")


def make_plan(rng: random.Random, n: int, dev_blocks: int, host_blocks: int) -> TransferPlan:
    """n scattered blocks: n/2 host->device, the rest device->host (a quarter of them eager)."""
    n_in = n // 2
    n_d2h = n - n_in
    n_eager = n_d2h // 4
    devs = rng.sample(range(dev_blocks), n)  # distinct: no block read and written at once
    hosts = rng.sample(range(host_blocks), n)
    d2h = list(zip(devs[:n_d2h], hosts[:n_d2h]))
    swap_in = list(zip(hosts[n_d2h:], devs[n_d2h:]))
    return TransferPlan(fence=1, swap_out=d2h[n_eager:], swap_in=swap_in, eager=d2h[:n_eager])


def _markers(pool: torch.Tensor) -> torch.Tensor:
    """The first 4 bytes of every block, as one int32 per block (a view)."""
    return pool.view(torch.uint8).view(pool.shape[0], -1)[:, :4].view(torch.int32)[:, 0]


def _mark(pool: torch.Tensor, base: int) -> None:
    """A distinct value at the start of every block, so a wrong copy is visible."""
    _markers(pool).copy_(torch.arange(base, base + pool.shape[0], dtype=torch.int32))


def _copied(plan: TransferPlan, dev: torch.Tensor, host: torch.Tensor) -> bool:
    d, h = _markers(dev).cpu(), _markers(host)
    return (all(bool(h[hb] == d[db]) for db, hb in plan.swap_out + plan.eager)
            and all(bool(d[db] == h[hb]) for hb, db in plan.swap_in))


def measure(shape: Shape, blocks: int, repeats: int, seed: int = 0,
            copy_rows: bool = False, device: str = "cpu") -> dict[str, Any]:
    rng = random.Random(seed)
    cuda = device == "cuda"
    variants = {**VARIANTS, **(COPY_VARIANTS if copy_rows and not cuda else {})}
    pool_blocks = 2 * blocks
    if cuda:
        mem = [allocate_host_pool(shape.block_shape, shape.dtype, num_blocks=pool_blocks,
                                  pin=True)]
        dev = torch.zeros((pool_blocks, *shape.block_shape), dtype=shape.dtype, device="cuda")
        host = mem[0].tensor
    else:
        mem = [allocate_host_pool(shape.block_shape, shape.dtype, num_blocks=pool_blocks,
                                  numa_node="off", pin=False) for _ in range(2)]
        dev, host = mem[0].tensor, mem[1].tensor
    raw_dir: dict[str, list[float]] = {"d2h": [], "h2d": []}
    try:
        _mark(dev, 0)
        _mark(host, 100_000)
        plan = make_plan(rng, blocks, pool_blocks, pool_blocks)
        nbytes = blocks * shape.block_bytes
        engines = {v: DuplexEngine(dev, host, m, cpu_copy=c) for v, (m, c) in variants.items()}
        for e in engines.values():  # warm-up: lane threads started, caches in a steady state
            e.transfer(plan)
        kinds = ["raw", *([] if cuda else ["raw_torch"]), *variants]
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        overlap: list[float] = []
        # Block-first runs one direction at a time: its busy time per direction gives the
        # GPU goal "per direction", beside the raw copy of that direction.
        one_way: dict[str, list[float]] = {"d2h": [], "h2d": []}
        flat_d, flat_h = dev.view(-1).view(torch.uint8), host.view(-1).view(torch.uint8)
        n_d2h = (len(plan.swap_out) + len(plan.eager)) * shape.block_bytes
        for _ in range(repeats):
            rng.shuffle(kinds)
            for kind in kinds:
                t0 = time.perf_counter()
                if kind == "raw" and cuda:
                    # One contiguous copy per direction, one after the other: the link.
                    flat_h[:n_d2h].copy_(flat_d[:n_d2h], non_blocking=True)
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    flat_d[n_d2h:nbytes].copy_(flat_h[n_d2h:nbytes], non_blocking=True)
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    raw_dir["d2h"].append(n_d2h / (t1 - t0) / 1e9)
                    raw_dir["h2d"].append((nbytes - n_d2h) / (t2 - t1) / 1e9)
                elif kind == "raw":
                    ctypes.memmove(flat_h.data_ptr(), flat_d.data_ptr(), nbytes)
                elif kind == "raw_torch":
                    flat_h[:nbytes].copy_(flat_d[:nbytes])
                else:
                    timing = engines[kind].transfer(plan)
                    if kind == Mode.DUPLEX.value:
                        overlap.append(timing.overlap)
                    if kind == Mode.BLOCK_FIRST.value and timing.d2h_s and timing.h2d_s:
                        one_way["d2h"].append(timing.bytes_d2h / timing.d2h_s / 1e9)
                        one_way["h2d"].append(timing.bytes_h2d / timing.h2d_s / 1e9)
                samples[kind].append(nbytes / (time.perf_counter() - t0) / 1e9)
            _mark(host, 100_000)  # the raw copies overwrote host blocks' markers
        for v, e in engines.items():  # every variant must have copied the right blocks
            _mark(dev, 0)
            _mark(host, 100_000)
            e.transfer(plan)
            if not _copied(plan, dev, host):
                raise RuntimeError(f"{v} copied the wrong bytes")
            e.close()
    finally:
        for m in mem:
            m.close()

    def stats(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    def per_repeat(xs: list[float], ys: list[float]) -> dict[str, float]:
        """Stats of x / y, each x against the y of its own repeat."""
        return stats([x / y for x, y in zip(xs, ys, strict=True)])

    out: dict[str, Any] = {
        "shape": shape.name,
        "segment_bytes": shape.segment_bytes,
        "block_bytes": shape.block_bytes,
        "blocks_moved": blocks,
        "d2h_blocks": len(plan.swap_out) + len(plan.eager),
        "h2d_blocks": len(plan.swap_in),
        "eager_blocks": len(plan.eager),
        "bytes_moved": nbytes,
        "device": device,
        "raw_gbps": statistics.median(samples["raw"]),
        "raw_torch_gbps": statistics.median(samples["raw_torch"]) if not cuda else None,
        "raw_d2h_gbps": statistics.median(raw_dir["d2h"]) if cuda else None,
        "raw_h2d_gbps": statistics.median(raw_dir["h2d"]) if cuda else None,
        "duplex_overlap": statistics.median(overlap),
        "block_first_d2h_gbps": statistics.median(one_way["d2h"]) if one_way["d2h"] else None,
        "block_first_h2d_gbps": statistics.median(one_way["h2d"]) if one_way["h2d"] else None,
        "samples_gbps": samples,
        "noise": {k: stats(v) for k, v in samples.items()},
    }
    for v in variants:
        key = _key(v)
        out[f"{key}_gbps"] = statistics.median(samples[v])
        out[f"{key}_vs_raw"] = per_repeat(samples[v], samples["raw"])

    def between(a: str, b: str) -> dict[str, float]:
        return per_repeat(samples[a], samples[b])

    out["block_first_vs_layer_first"] = between("block-first", "layer-first")
    if copy_rows:
        out["block_first_vs_layer_first_copy_"] = between("block-first", "layer-first/copy_")
    out["duplex_vs_block_first"] = between("duplex", "block-first")
    out["duplex_vs_layer_first"] = between("duplex", "layer-first")
    if cuda and one_way["d2h"]:  # the link one way, direction by direction
        for d in ("d2h", "h2d"):
            out[f"block_first_{d}_vs_raw"] = per_repeat(one_way[d], raw_dir[d])
    out["goals"] = goals(out)
    return out


# The transfer engine's targets: (name, measured ratio's key, at least, what it says), on the CPU and the
# GPU alike; "≥ 3x layer-first" names no mode, so it is checked
# for block-first (one direction at a time, like the baseline) and for duplex (what kvmem
# runs) separately. On a GPU the raw copy is the link one way, direction by direction.
GOALS = [
    ("block_first_share_of_raw", "block_first_vs_raw", 0.90,
     "block-first moves >= 90 % of what one raw copy moves (one-way link bandwidth on a GPU)"),
    ("block_first_over_layer_first", "block_first_vs_layer_first", 3.0,
     "block-first beats the layer-first baseline by >= 3x"),
    ("duplex_over_layer_first", "duplex_vs_layer_first", 3.0,
     "duplex (kvmem's default) beats the layer-first baseline by >= 3x"),
    ("duplex_over_one_direction", "duplex_vs_block_first", 1.7,
     "duplex moves >= 1.7x what one direction at a time moves"),
]


# On a GPU, block-first's share of the link is also checked per direction (its busy time on
# that direction's stream against one large copy in that direction).
GPU_GOALS = [
    (f"block_first_{d}_share_of_link", f"block_first_{d}_vs_raw", 0.90,
     f"block-first {label} moves >= 90 % of one large {label} copy")
    for d, label in (("d2h", "device->host"), ("h2d", "host->device"))
]


def goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the median of its per-repeat ratio and whether that meets it."""
    return [{"goal": name, "ratio": key, "median": r[key]["median"], "min": r[key]["min"],
             "target": target, "met": r[key]["median"] >= target, "says": says}
            for name, key, target, says in [*GOALS, *GPU_GOALS] if key in r]


def _key(variant: str) -> str:
    """JSON key stem: layer-first -> layer_first, layer-first/copy_ -> layer_first_torch."""
    return variant.replace("/copy_", "_torch").replace("-", "_")


def run(args: argparse.Namespace) -> int:
    if args.nt_threshold != "default" and nt_threshold_in_effect() is None:
        return _rerun_with_nt(args)
    shapes = {s.name: s for s in SHAPES}
    unknown = [n for n in args.shapes.split(",") if n not in shapes]
    if unknown or args.repeats < 1 or (args.blocks is not None and args.blocks < 2):
        print(f"bad arguments: shapes {unknown or 'ok'}, repeats >= 1, blocks >= 2",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    results = []
    for name in args.shapes.split(","):
        s = shapes[name]
        results.append(measure(s, args.blocks or s.default_blocks, args.repeats, args.seed,
                               args.copy_rows, args.device))
    nt = nt_threshold_in_effect() or "glibc default"
    print(f"KV block transfers, GB/s both ways (median of {args.repeats}; [min-max]); "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {NT_KEY}: {nt}")
    rows = []
    for r in results:
        n = r["noise"]
        variants = [v for v in (*VARIANTS, *COPY_VARIANTS) if f"{_key(v)}_gbps" in r]
        raws = ([("raw", "raw: one copy per direction")] if r["device"] == "cuda" else
                [("raw", "raw memmove"), ("raw_torch", "raw torch copy_")])
        for kind, label in (*raws, *((v, v) for v in variants)):
            if kind in variants:
                q = r[f"{_key(kind)}_vs_raw"]
                vs_raw = f"{q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}]"
            else:
                vs_raw = f"{n[kind]['median'] / r['raw_gbps']:.2f}"
            rows.append([r["shape"], label, f"{n[kind]['median']:.2f}",
                         f"{n[kind]['min']:.2f}-{n[kind]['max']:.2f}", vs_raw])
    print(table(["shape", "mode", "GB/s", "range", "x raw (per repeat)"], rows))

    def fmt(q: dict[str, float]) -> str:
        return f"{q['median']:.2f}x [{q['min']:.2f}-{q['max']:.2f}]"

    for r in results:
        print(f"{r['shape']}: {r['blocks_moved']} blocks of {r['block_bytes'] / 2**10:.0f} KiB "
              f"(segments of {r['segment_bytes'] / 2**10:.0f} KiB), "
              f"{r['bytes_moved'] / 2**20:.0f} MiB; block-first / layer-first "
              f"{fmt(r['block_first_vs_layer_first'])}"
              + (f", / layer-first copy_ {fmt(r['block_first_vs_layer_first_copy_'])}"
                 if "block_first_vs_layer_first_copy_" in r else "")
              + f"; duplex / block-first {fmt(r['duplex_vs_block_first'])}, "
              f"duplex overlap {r['duplex_overlap']:.2f}"
              + (f"; raw D2H {r['raw_d2h_gbps']:.1f}, H2D {r['raw_h2d_gbps']:.1f} GB/s"
                 if r["device"] == "cuda" else ""))
    print(table(["shape", "goal", "median [min]", "target", "met"],
                [[r["shape"], g["ratio"].replace("_vs_", " / ").replace("_", "-"), f"{g['median']:.2f} [{g['min']:.2f}]",
                  f">= {g['target']:g}", "yes" if g["met"] else "NO"]
                 for r in results for g in r["goals"]]))
    if nt == "glibc default" and args.device == "cpu":
        print(f"note: block copies here use cached stores; kvmem runs with --nt-threshold "
              f"{NT_THRESHOLD}, where they get the non-temporal stores a large memmove gets")
    write_json(args.json, {
        "cpus": os.cpu_count(), "nt_threshold": nt, "repeats": args.repeats,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "shapes": {r["shape"]: r for r in results},
    })
    return 0


def _rerun_with_nt(args: argparse.Namespace) -> int:
    """GLIBC_TUNABLES is read at process start: measure in a child that has it."""
    env = with_nt_threshold(dict(os.environ), args.nt_threshold)
    argv = ["--repeats", str(args.repeats), "--shapes", args.shapes, "--seed", str(args.seed),
            "--nt-threshold", "default", "--device", args.device]  # the child has it in its environment already
    if args.copy_rows:
        argv.append("--copy-rows")
    if args.blocks is not None:
        argv += ["--blocks", str(args.blocks)]
    if args.json:
        argv += ["--json", args.json]
    return subprocess.run([sys.executable, "-m", "superinfer.bench.transfer", *argv],
                          env=env, check=False).returncode


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench transfer")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
