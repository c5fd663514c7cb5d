"""Decode throughput and TTFT of the engine vs transformers' generate(), same batch sizes.

Both sides run the same prompts (one per batch slot), greedy, a fixed number of new
tokens with EOS ignored, in this process one after the other: transformers in fp32, the
engine in `--dtype` (default auto, as `superinfer serve`: the executor's fastest format
that passes the quality check; float32 compares like with like). Timings on a shared
CPU are noisy: read the ratio, not the absolute numbers, and repeat when in doubt.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from common.config import DTYPE_NAMES, EngineConfig
from scheduler_svc.request import SamplingParams
from superinfer.bench.report import table, write_json
from superinfer.engine import LLMEngine

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a refrigerator works.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes.",
    "Describe the water cycle in simple terms.",
    "Why do cats purr?",
    "List some tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per side; the best is kept")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                   help="the engine's weight format (default auto, as the server's)")


def _ours(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(mean TTFT s, decode tok/s) for one batch submitted at once."""
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    ids = [engine.add_request(p, sp, arrival_time=t0) for p in prompts]
    first: dict[str, float] = {}
    while engine.scheduler.has_unfinished():
        for ev in engine.step():
            first.setdefault(ev.request_id, time.monotonic())
    end = time.monotonic()
    for rid in ids:
        engine.trackers.pop(rid, None)
    engine.scheduler.collect_finished()
    ttft = sum(first[r] - t0 for r in ids) / len(ids)
    decode_tokens = len(prompts) * (new - 1)
    return ttft, decode_tokens / (end - max(first.values()) + 1e-9) if new > 1 else 0.0


def _hf(model: Any, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """Same measures for transformers: left-padded batch, greedy generate()."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    # EOS off (not min_new_tokens, which adds a logits processor) so both sides do the
    # same work per step.
    model.generation_config.eos_token_id = None
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.monotonic()
        model.generate(ids, max_new_tokens=1, **kw)
        ttft = time.monotonic() - t0
        t0 = time.monotonic()
        model.generate(ids, max_new_tokens=new, **kw)
        total = time.monotonic() - t0
    decode_tokens = len(prompts) * (new - 1)
    return ttft, decode_tokens / max(total - ttft, 1e-9)


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    # Prefix caching off: every repeat runs the same prompts, and this measures the forward
    # pass (a cached prompt's TTFT would say nothing about it).
    engine = LLMEngine(EngineConfig(device_blocks=2048, host_blocks=0,
                                    max_batched_tokens=4096, dtype=args.dtype,
                                    enable_prefix_caching=False))
    fmt = engine.built.format.name
    hf = None
    if not args.no_hf:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        path = engine.source.path
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    encoded = [engine.encode_prompt(p, chat=True) for p in PROMPTS]
    _ours(engine, encoded[:1], 4)  # warm up
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [encoded[i % len(encoded)] for i in range(b)]
        ours, theirs = [], []
        # Alternate the two sides and keep each one's best run: on a shared machine the
        # best of a few runs is the least disturbed measure of what each can do.
        for _ in range(args.repeats):
            ours.append(_ours(engine, prompts, args.new_tokens))
            if hf is not None:
                theirs.append(_hf(hf, prompts, args.new_tokens))
        ttft, tps = min(o[0] for o in ours), max(o[1] for o in ours)
        row: dict[str, Any] = {"batch": b, "ttft_s": ttft, "decode_tok_s": tps}
        if hf is not None:
            h_ttft, h_tps = min(t[0] for t in theirs), max(t[1] for t in theirs)
            row.update(hf_ttft_s=h_ttft, hf_decode_tok_s=h_tps,
                       decode_ratio=tps / h_tps, ttft_ratio=h_ttft / ttft)
        rows.append(row)
        print(f"batch {b}: done", flush=True)
    keys = list(rows[0].keys())
    print(f"engine ({fmt}) vs transformers (fp32), bundled model, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads (ratios > 1: SuperInfer ahead)")
    print(table(keys, [[r.get(k, "") for k in keys] for r in rows]))
    write_json(args.json, {"dtype": fmt, "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
                           "repeats": args.repeats, "results": rows})
    return 0
