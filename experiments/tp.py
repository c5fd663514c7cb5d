"""`python -m experiments tp`: decode throughput of tensor parallel (worker/tp.py) vs one rank.

A synthetic Llama (random, seed-fixed, built with transformers' LlamaConfig and saved as a
Hugging Face directory: nothing is downloaded) is run three ways, fp32, on the plain-torch
forward TP uses, through the worker's ModelRunner:

* `tp1`: the whole model in one rank with all the cores' threads (what a worker runs);
* `tp1-1t`: the same with one thread (what one rank of the split gets);
* `tp2`: two ranks (this process as rank 0, a `python -m worker.tp_rank` process as rank 1,
  gloo), one thread each; per phase one lm_head (`--lm-heads`): replicated (computed on
  rank 0 only) or vocab-parallel (each rank its half of the vocabulary, gathered).

Per batch size: prefill one prompt per slot, then time `--steps` decode steps; the modes
alternate round by round (`--rounds`), the median tok/s is kept; each phase (a new rank 1
with its lm_head) measures its own tp1 baselines. For tp2 the share of rank
0's step spent in the all-reduces is measured too, and rank 1's CPU time while the other
modes run (it waits in a broadcast: it should be idle). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from common.config import EngineConfig
from common.contracts import ScheduledChunk
from superinfer.bench.report import table, write_json
from worker.build import Shard, build_shard
from worker.runner import ModelRunner
from worker.threads import ThreadTuner
from worker.tp import join_group, master_store, start_ranks, stop_ranks

BLOCK = 16
PROMPT_LEN = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the modes")
    p.add_argument("--lm-heads", default="replicated,vocab",
                   help="tp2's lm_head per phase (worker/tp.py LM_HEADS); each phase "
                        "measures its own tp1 baselines")
    p.add_argument("--json", default=None)


def synthetic_model(args: argparse.Namespace, out: Path) -> Path:
    """A random Llama saved as an HF directory (transformers builds it; seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _runner(shard: Shard, threads: int, blocks: int, group: Any = None) -> ModelRunner:
    c = shard.model.cfg
    kv = torch.zeros((blocks, c.num_layers, 2, BLOCK, c.num_kv_heads, c.head_dim),
                     dtype=shard.kv_dtype)
    return ModelRunner(shard.model, kv, BLOCK, shard.weights, tuner=ThreadTuner((threads,)),
                       group=group)


def decode_tok_s(runner: ModelRunner, batch: int, steps: int, vocab: int) -> float:
    """Prefill `batch` prompts, then time `steps` greedy decode steps of all of them."""
    per = (PROMPT_LEN + steps + 1) // BLOCK + 1
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    prompts = [[(31 * i + 7 * j) % vocab for j in range(PROMPT_LEN)] for i in range(batch)]
    out = runner.execute([ScheduledChunk(f"r{i}", p, 0, tables[i], True, temperature=0.0)
                          for i, p in enumerate(prompts)]).sampled
    last = [out[f"r{i}"] for i in range(batch)]
    t0 = time.perf_counter()
    for s in range(steps):
        out = runner.execute([ScheduledChunk(f"r{i}", [last[i]], PROMPT_LEN + s, tables[i], True,
                                             temperature=0.0) for i in range(batch)]).sampled
        last = [out[f"r{i}"] for i in range(batch)]
    return batch * steps / (time.perf_counter() - t0)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _phase(args: argparse.Namespace, cfg: EngineConfig, whole: Shard, blocks: int,
           lm_head: str, run_dir: Path) -> tuple[dict[str, dict[int, list[float]]],
                                                dict[int, list[float]], float]:
    """One rank-1 process with `lm_head`; tp1, tp1-1t and tp2 alternate per batch size.
    Returns tok/s per mode and batch, tp2's all-reduce share per batch, and rank 1's CPU
    seconds while the tp1 modes ran."""
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cores = os.cpu_count() or 1
    store = master_store(2)
    env_threads = os.environ.pop("OMP_NUM_THREADS", None)  # rank 1: cores // 2 threads
    procs = start_ranks(2, store, asdict(cfg), run_dir, "warning", lm_head)
    if env_threads is not None:
        os.environ["OMP_NUM_THREADS"] = env_threads
    group = None
    try:
        shard = build_shard(cfg, 0, 2, lm_head=lm_head)
        group = join_group(0, 2, store)
        reduce_s = [0.0]

        def timed_reduce(x: torch.Tensor) -> torch.Tensor:
            t = time.perf_counter()
            group.all_reduce(x)
            reduce_s[0] += time.perf_counter() - t
            return x

        shard.model.reduce = timed_reduce
        if lm_head == "vocab":
            shard.model.gather = group.gather_vocab
        runners = {"tp1": _runner(whole, cores, blocks), "tp1-1t": _runner(whole, 1, blocks),
                   "tp2": _runner(shard, max(1, cores // 2), blocks, group)}
        for r in runners.values():  # warm-up: threads, allocator, gloo pairs
            decode_tok_s(r, 2, 4, args.vocab)
        results: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batches}
                                                      for m in runners}
        shares: dict[int, list[float]] = {b: [] for b in batches}
        idle_cpu = 0.0
        for _ in range(args.rounds):
            for b in batches:
                for mode, r in runners.items():
                    c0, reduce_s[0] = _cpu_s(procs[0].pid), 0.0
                    t0 = time.perf_counter()
                    results[mode][b].append(decode_tok_s(r, b, args.steps, args.vocab))
                    wall = time.perf_counter() - t0
                    if mode == "tp2":
                        shares[b].append(reduce_s[0] / wall)
                    else:
                        idle_cpu += _cpu_s(procs[0].pid) - c0
        group.send_batch(None)
    finally:
        if group is not None:
            group.close()
        stop_ranks(procs)
    return results, shares, idle_cpu


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cores = os.cpu_count() or 1
    rows, data, idle = [], [], {}
    with tempfile.TemporaryDirectory(prefix="superinfer-bench-tp-") as d:
        path = synthetic_model(args, Path(d) / "model")
        per = (PROMPT_LEN + args.steps + 1) // BLOCK + 1
        blocks = per * max(batches)
        cfg = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK,
                           device_blocks=blocks, tensor_parallel_size=2)
        whole = build_shard(cfg, 0, 1)
        for lm_head in args.lm_heads.split(","):
            results, shares, idle[lm_head] = _phase(args, cfg, whole, blocks, lm_head, Path(d))
            for b in batches:
                med = {m: statistics.median(v[b]) for m, v in results.items()}
                row = {"lm_head": lm_head, "batch": b, **{f"{m}_tok_s": med[m] for m in med},
                       "tp2_vs_tp1": med["tp2"] / med["tp1"],
                       "tp2_vs_tp1_1t": med["tp2"] / med["tp1-1t"],
                       "tp2_allreduce_share": statistics.median(shares[b]),
                       "runs": {m: results[m][b] for m in results}}
                data.append(row)
                rows.append([lm_head, b, med["tp1"], med["tp1-1t"], med["tp2"],
                             row["tp2_vs_tp1"], row["tp2_vs_tp1_1t"], row["tp2_allreduce_share"]])
    print(table(["tp2 lm_head", "batch", f"tp1 ({cores}t) tok/s", "tp1 (1t) tok/s",
                 "tp2 (1t/rank) tok/s", "tp2/tp1", "tp2/tp1-1t", "all-reduce share"], rows))
    print("rank 1 CPU while idle (the tp1 runs): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in idle.items()))
    c = whole.full
    write_json(args.json, {
        "command": " ".join(["python", "-m", "experiments", "tp", *sys.argv[2:]]),
        "model": {"hidden": c.hidden_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
                  "layers": c.num_layers, "intermediate": c.intermediate_size,
                  "vocab": c.vocab_size, "dtype": "float32"},
        "cores": cores, "steps": args.steps, "rounds": args.rounds, "prompt_len": PROMPT_LEN,
        "lm_head": {"replicated": "whole on every rank, computed on rank 0 only",
                    "vocab": "1/N of the vocabulary rows per rank, logits gathered on rank 0"},
        "rank1_idle_cpu_s": idle, "rows": data,
    })
    return 0
