"""`superinfer bench gpu-worker`: the CUDA worker's checks, one command.

* greedy — the bundled model through `CudaModelRunner` (bf16 on the GPU) against the CPU
  runner in fp32: 24 prompts, greedy, each side feeding itself its own tokens; a prompt is
  token-exact over n tokens when its first n generated tokens agree.
* decode — decode tok/s of a Llama-3-8B-shaped model with RANDOM bf16 weights (no download;
  says nothing about text) at each batch size, context `--context` tokens per sequence, each
  batch size under its own CUDA graph, beside its roofline: the larger of bytes read
  (weights + KV) over the card's memory bandwidth and FLOPs over its bf16 peak.
* merge — with `--transfer-json` / `--kill9-json` / `--pytest-rc`, the other checks'
  results are folded into the one JSON (`--json`, scripts/gpu_check.sh: gpu_check.json).

`--dry-run` runs the same code on the CPU with the kernels under Triton's interpreter
(TRITON_INTERPRET=1), a tiny random model for `decode` and a few short prompts: it checks
the logic, not the speed (tests/test_bench_gpu_worker.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.contracts import ScheduledChunk
from superinfer.bench.report import table, write_json

# 24 prompts: prose, lists, code, arithmetic, translation, facts.
PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,",
    "def fibonacci(n):", "Hello, my name is", "The three primary colors are",
    "Translate to German: good morning", "Once upon a time, in a small village,",
    "The largest planet in our solar system is", "List three fruits that are red:",
    "import numpy as np\n", "Water boils at a temperature of", "The quick brown fox",
    "A haiku about autumn:", "Q: What is 12 times 12?\nA:", "SELECT name FROM users WHERE",
    "The first president of the United States was", "Monday, Tuesday, Wednesday,",
    "In machine learning, a neural network is", "Dear hiring manager,",
    "The chemical symbol for gold is", "for i in range(10):", "My favourite book is",
    "Photosynthesis is the process by which",
]
# (memory bandwidth B/s, dense bf16 FLOP/s) by device name; --peak-* override.
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.039e12, 312e12),
         "L40S": (0.864e12, 362e12)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="greedy,decode,attention",
                   help="greedy, decode, attention (comma-separated)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--peak-bw-gbs", type=float, default=None)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--transfer-json", default=None)
    p.add_argument("--kill9-json", default=None)
    p.add_argument("--pytest-rc", type=int, default=None, help="exit status of the gpu tests")
    p.add_argument("--merge-into", default=None, metavar="JSON",
                   help="start from this earlier result (its greedy/decode/attention parts "
                        "are kept unless rerun) and fold the other checks into it")
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU, tiny shapes, kernels interpreted: the logic only")
    p.add_argument("--json", default=None)


# -- greedy agreement ----------------------------------------------------------------------------
def tables_for(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Disjoint block tables, one per sequence of `lengths` tokens."""
    out, nxt = [], 0
    for n in lengths:
        k = -(-n // block_size)
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    return out


def greedy_tokens(execute: Any, prompts: Sequence[list[int]], n: int, block_size: int
                  ) -> list[list[int]]:
    """n greedy tokens per prompt: one prefill batch of every prompt, then batched decodes."""
    tables = tables_for([len(p) + n for p in prompts], block_size)
    ids = [f"p{i}" for i in range(len(prompts))]
    step = [ScheduledChunk(r, list(p), 0, t, True, temperature=0.0)
            for r, p, t in zip(ids, prompts, tables, strict=True)]
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(n):
        got = execute(step).sampled
        for i, r in enumerate(ids):
            out[i].append(got[r])
        step = [ScheduledChunk(r, [out[i][-1]], len(prompts[i]) + k, tables[i], True,
                               temperature=0.0, output_index=k + 1)
                for i, r in enumerate(ids)]
    return out


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], n: int) -> int:
    """Prompts whose first n tokens agree."""
    return sum(list(x[:n]) == list(y[:n]) for x, y in zip(a, b, strict=True))


def run_greedy(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
               ) -> dict[str, Any]:
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer
    from worker.cuda.model import CudaLlama
    from worker.cuda.runner import CudaModelRunner
    from worker.loader import load_weights
    from worker.model import LlamaModel
    from worker.runner import ModelRunner

    source = resolve_model(None)
    tok = Tokenizer.from_source(source)
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    n, bs = args.greedy_tokens, 16
    mcfg, weights = load_weights(source.path, source.kind, torch.float32)
    blocks = sum(len(t) for t in tables_for([len(p) + n for p in prompts], bs))
    kv_shape = (blocks, mcfg.num_layers, 2, bs, mcfg.num_kv_heads, mcfg.head_dim)
    cuda_model = CudaLlama(mcfg, dict(weights), device, dtype)  # a copy: LlamaModel eats its dict
    from worker import kernels

    ref_model = LlamaModel(mcfg, weights, None, kernels.load())  # the fp32 CPU reference
    ref_model.add_weights("float32", "fp32", "fp32")
    ref = ModelRunner(ref_model, torch.zeros(kv_shape), bs, "float32")
    t0 = time.perf_counter()
    want = greedy_tokens(ref.execute, prompts, n, bs)
    ref_s = time.perf_counter() - t0
    max_len = max(len(p) for p in prompts) + n
    runner = CudaModelRunner(cuda_model, torch.zeros(kv_shape, dtype=dtype, device=device), bs,
                             max_batch=len(prompts), max_model_len=max_len + bs)
    t0 = time.perf_counter()
    got = greedy_tokens(runner.execute, prompts, n, bs)
    dev_s = time.perf_counter() - t0
    first = min(8, n)
    return {
        "model": source.name, "dtype": str(dtype).removeprefix("torch."), "tokens": n,
        "greedy_exact": {"count": agreement(got, want, n), "total": len(prompts), "tokens": n},
        "greedy_exact_first8": {"count": agreement(got, want, first), "total": len(prompts),
                                "tokens": first},
        "graph_steps": runner.graph_steps, "eager_steps": runner.eager_steps,
        "reference_s": round(ref_s, 2), "device_s": round(dev_s, 2),
        "mismatches": [{"prompt": PROMPTS[i], "device": tok.decode(g), "reference": tok.decode(w)}
                       for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w][:6],
    }


# -- decode speed and its roofline -------------------------------------------------------------
def roofline(cfg: Any, batch: int, context: int, itemsize: int, peak_bw: float | None,
             peak_flops: float | None) -> dict[str, Any]:
    """Bytes and FLOPs of one decode step, and the tok/s the card's peaks allow."""
    L, D, hq, hkv, hd = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim)
    per_layer = D * (hq + 2 * hkv) * hd + hq * hd * D + 3 * D * cfg.intermediate_size
    matmul_params = L * per_layer + cfg.vocab_size * D  # + lm_head; the embedding is a gather
    weight_bytes = (matmul_params + (2 * L + 1) * D) * itemsize
    kv_bytes = batch * context * L * 2 * hkv * hd * itemsize
    flops = 2 * matmul_params * batch + 4 * batch * context * L * hq * hd
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops}
    if peak_bw and peak_flops:
        t_mem, t_flop = (weight_bytes + kv_bytes) / peak_bw, flops / peak_flops
        out.update(bound="memory" if t_mem >= t_flop else "compute",
                   roofline_tok_s=batch / max(t_mem, t_flop))
    return out


def peaks(args: argparse.Namespace, device: torch.device) -> tuple[float | None, float | None]:
    bw = args.peak_bw_gbs * 1e9 if args.peak_bw_gbs else None
    fl = args.peak_tflops * 1e12 if args.peak_tflops else None
    if device.type == "cuda" and (bw is None or fl is None):
        name = torch.cuda.get_device_name(device)
        known = next((v for k, v in PEAKS.items() if k in name), None)
        if known:
            bw, fl = bw or known[0], fl or known[1]
    return bw, fl


def run_decode(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
               ) -> dict[str, Any]:
    from worker.cuda.model import CudaLlama
    from worker.cuda.random_model import llama3_8b_config, random_weights, tiny_config
    from worker.cuda.runner import CudaModelRunner

    cfg = tiny_config() if args.dry_run else llama3_8b_config()
    batches = [int(b) for b in args.batches.split(",")]
    bs, ctx, steps, warm = 16, args.context, args.steps, 3
    span = ctx + warm + steps + 1
    if span > cfg.max_position:
        raise ValueError(f"--context {ctx} + steps passes the model's {cfg.max_position}")
    nb = -(-span // bs)
    model = CudaLlama(cfg, random_weights(cfg, device, dtype), device, dtype)
    pool = torch.zeros((max(batches) * nb, cfg.num_layers, 2, bs, cfg.num_kv_heads,
                        cfg.head_dim), dtype=dtype, device=device)
    bw, fl = peaks(args, device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for b in batches:
        runner = CudaModelRunner(model, pool, bs, max_batch=b, max_model_len=nb * bs,
                                 buckets=(b,))
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]

        def step(k: int, runner: CudaModelRunner = runner, tables: list[list[int]] = tables,
                 b: int = b) -> None:
            runner.execute([ScheduledChunk(f"s{i}", [1 + (i + k) % (cfg.vocab_size - 1)],
                                           ctx + k, tables[i], True, temperature=0.0)
                            for i in range(b)])

        for k in range(warm):
            step(k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for k in range(warm, warm + steps):
            step(k)  # each step ends reading its sampled tokens: synchronised
        dt = time.perf_counter() - t0
        row: dict[str, Any] = {"batch": b, "context": ctx, "steps": steps,
                               "decode_tok_s": b * steps / dt, "step_ms": 1e3 * dt / steps,
                               "graph_steps": runner.graph_steps,
                               "eager_steps": runner.eager_steps,
                               **roofline(cfg, b, ctx, itemsize, bw, fl)}
        if "roofline_tok_s" in row:
            row["roofline_fraction"] = row["decode_tok_s"] / row["roofline_tok_s"]
        rows.append(row)
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": cfg.name, "random_weights": True, "peak_bw_Bps": bw, "peak_flops": fl,
            "weight_bytes_on_device": model.weight_bytes,
            "per_batch": {str(r["batch"]): r for r in rows}}


# -- the decode attention kernel alone, per tile choice -----------------------------------------
ATTENTION_CONFIGS = [(64, 4, None), (128, 4, None), (64, 8, None), (128, 8, None), (32, 4, 2)]


def run_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
                  ) -> dict[str, Any]:
    """GB/s of one layer's paged decode attention (block_n, num_warps, num_stages), at the
    largest batch and --context: the kernel's share of the card's bandwidth, to tune it."""
    from worker.cuda.kernels import paged_attention
    from worker.cuda.random_model import llama3_8b_config, tiny_config

    cfg = tiny_config() if args.dry_run else llama3_8b_config()
    batch, ctx, bs = max(int(b) for b in args.batches.split(",")), args.context, 16
    nb = -(-(ctx + 1) // bs)
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn((batch * nb, 1, 2, bs, hkv, hd), generator=g, device=device,
                       dtype=torch.float32).to(dtype)
    q = torch.randn((batch, hq, hd), generator=g, device=device, dtype=torch.float32).to(dtype)
    i32 = torch.int32
    tables = torch.arange(batch * nb, dtype=i32, device=device).view(batch, nb)
    starts = torch.arange(batch, dtype=i32, device=device)
    ones = torch.ones(batch, dtype=i32, device=device)
    ctx_start = torch.full((batch,), ctx, dtype=i32, device=device)
    kv_bytes = batch * (ctx + 1) * 2 * hkv * hd * pool.element_size()
    bw, _ = peaks(args, device)
    iters = 2 if args.dry_run else 50
    rows, ref = [], None
    for bn, warps, stages in ATTENTION_CONFIGS:
        def call(bn: int = bn, warps: int = warps, stages: int | None = stages) -> torch.Tensor:
            return paged_attention(q, pool[:, 0, 0], pool[:, 0, 1], tables, starts, ones,
                                   ctx_start, 1, hd ** -0.5, block_n=bn, num_warps=warps,
                                   num_stages=stages)

        out = call()
        ref = out if ref is None else ref
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / iters
        rows.append({"block_n": bn, "num_warps": warps, "num_stages": stages, "us": dt * 1e6,
                     "gbps": kv_bytes / dt / 1e9,
                     "share_of_peak_bw": kv_bytes / dt / bw if bw else None,
                     "max_diff_vs_first": float((out.float() - ref.float()).abs().max())})
    return {"batch": batch, "context": ctx, "kv_bytes_per_layer": kv_bytes, "configs": rows}


# -- the other checks' results ---------------------------------------------------------------------
def merge_transfer(path: str) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    out: dict[str, Any] = {}
    def med(r: dict[str, Any], key: str) -> float | None:
        v = r.get(key)
        return v["median"] if isinstance(v, dict) else None

    for name, r in data.get("shapes", {}).items():
        out[name] = {
            "block_bytes": r.get("block_bytes"),
            "block_first_vs_raw_d2h": med(r, "block_first_d2h_vs_raw"),
            "block_first_vs_raw_h2d": med(r, "block_first_h2d_vs_raw"),
            "duplex_vs_one_way": med(r, "duplex_vs_block_first"),
            "layer_first_slowdown": med(r, "block_first_vs_layer_first"),
        }
    return out


MUST = [  # (what, key path, at least)
    ("greedy exact over 32 tokens (of 24)", ("greedy", "greedy_exact", "count"), 12),
    ("greedy exact over the first 8 (of 24)", ("greedy", "greedy_exact_first8", "count"), 20),
    ("8B decode, batch 256: share of roofline", ("decode", "per_batch", "256",
                                                 "roofline_fraction"), 0.60),
    ("8B decode, batch 1: share of roofline", ("decode", "per_batch", "1",
                                               "roofline_fraction"), 0.50),
]
TRANSFER_MUST = [("block_first_vs_raw_d2h", 0.90), ("block_first_vs_raw_h2d", 0.90),
                 ("duplex_vs_one_way", 1.6), ("layer_first_slowdown", 3.0)]


def dig(d: Any, path: Sequence[str]) -> Any:
    for k in path:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def verdicts(result: dict[str, Any]) -> list[list[Any]]:
    rows = [[what, dig(result, path), f">= {goal:g}"] for what, path, goal in MUST]
    for shape, r in (result.get("transfer") or {}).items():
        if (r.get("block_bytes") or 0) < 2 << 20:
            continue  # the goals' figures are for 4 MiB-class blocks
        rows += [[f"{shape}: {k.replace('_', ' ')}", r.get(k), f">= {goal:g}"]
                 for k, goal in TRANSFER_MUST]
    if "kill9" in result:
        k = result["kill9"]
        rows.append(["kill -9 under load: streams exact", k.get("kill9_streams_exact"),
                     f"= {k.get('streams')}"])
    out = []
    for what, value, goal in rows:
        if value is None:
            met = "not run"
        elif goal.startswith("="):
            met = "yes" if str(value) == goal[2:] else "NO"
        else:
            met = "yes" if value >= float(goal[3:]) else "NO"
        out.append([what, "-" if value is None else
                    (f"{value:.3f}" if isinstance(value, float) else value), goal, met])
    return out


def run(args: argparse.Namespace) -> int:
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - {"greedy", "decode", "attention"}:
        print(f"unknown --parts {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("superinfer bench gpu-worker: torch sees no CUDA device (use --dry-run on the "
              "CPU to check the logic)", file=sys.stderr)
        return 2
    else:
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    result: dict[str, Any] = {}
    if args.merge_into and Path(args.merge_into).exists():
        result = json.loads(Path(args.merge_into).read_text())
    result.update({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": args.dry_run,
    })
    if "greedy" in parts:
        result["greedy"] = run_greedy(args, device, dtype)
        result["greedy_exact"] = result["greedy"]["greedy_exact"]
    if "decode" in parts:
        result["decode"] = run_decode(args, device, dtype)
        result["decode_tok_s"] = {b: r["decode_tok_s"]
                                  for b, r in result["decode"]["per_batch"].items()}
        result["roofline_fraction"] = {b: r.get("roofline_fraction")
                                       for b, r in result["decode"]["per_batch"].items()}
    if "attention" in parts:
        result["attention"] = run_attention(args, device, dtype)
    if args.transfer_json and Path(args.transfer_json).exists():
        result["transfer"] = merge_transfer(args.transfer_json)
        big = [r for r in result["transfer"].values() if (r["block_bytes"] or 0) >= 2 << 20]
        for k, _ in TRANSFER_MUST:
            result[k] = {s: r[k] for s, r in result["transfer"].items()
                         if r in big} or None
    if args.kill9_json and Path(args.kill9_json).exists():
        result["kill9"] = json.loads(Path(args.kill9_json).read_text())
        result["kill9_streams_exact"] = result["kill9"].get("kill9_streams_exact")
    if args.pytest_rc is not None:
        result["gpu_tests_passed"] = args.pytest_rc == 0
    if "decode" in result:
        print("decode, " + result["decode"]["model"] + " (RANDOM weights), context "
              f"{args.context}:")
        print(table(["batch", "tok/s", "ms/step", "roofline tok/s", "share", "bound", "graphs"],
                    [[r["batch"], f"{r['decode_tok_s']:.1f}", f"{r['step_ms']:.2f}",
                      f"{r['roofline_tok_s']:.1f}" if "roofline_tok_s" in r else "-",
                      f"{r['roofline_fraction']:.2f}" if "roofline_fraction" in r else "-",
                      r.get("bound", "-"), f"{r['graph_steps']}/{r['graph_steps'] + r['eager_steps']}"]
                     for r in result["decode"]["per_batch"].values()]))
    if "attention" in result:
        a = result["attention"]
        print(f"paged decode attention, one layer, batch {a['batch']}, context {a['context']} "
              f"({a['kv_bytes_per_layer'] / 2**20:.0f} MiB of KV):")
        print(table(["block_n", "warps", "stages", "us", "GB/s", "of peak", "max diff"],
                    [[r["block_n"], r["num_warps"], r["num_stages"] or "-", f"{r['us']:.1f}",
                      f"{r['gbps']:.1f}", f"{r['share_of_peak_bw']:.2f}"
                      if r["share_of_peak_bw"] else "-", f"{r['max_diff_vs_first']:.1e}"]
                     for r in a["configs"]]))
    if "greedy" in result:
        g = result["greedy"]
        print(f"greedy, {g['model']} {g['dtype']} on {result['device']} vs CPU fp32: "
              f"{g['greedy_exact']['count']}/{g['greedy_exact']['total']} exact over "
              f"{g['tokens']} tokens, {g['greedy_exact_first8']['count']}/"
              f"{g['greedy_exact_first8']['total']} over the first {g['greedy_exact_first8']['tokens']}")
    result["must_show"] = [dict(zip(("check", "value", "target", "met"), r, strict=True))
                           for r in verdicts(result)]
    print(table(["check", "value", "target", "met"], verdicts(result)))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench gpu-worker")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
