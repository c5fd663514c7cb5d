"""`python -m experiments quality`: how close each executor format stays to float32.

For every format this machine runs (worker/formats.py): perplexity on the text the
project ships (worker/data, public domain), its change against float32's (`--dtype auto`
takes a format only within 2 %), top-1 agreement with float32 at every position of that
text, and greedy agreement over a prompt set (identical continuations, and the mean
number of leading tokens that match float32's).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from superinfer.bench.engine import PROMPTS as ENGINE_PROMPTS
from superinfer.bench.report import table, write_json

# bench engine's prompts, and two with short, factual answers.
PROMPTS = [*ENGINE_PROMPTS, "What is the capital of France?",
           "Translate 'good morning' into Spanish."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: bundled)")
    p.add_argument("--formats", default=None,
                   help="comma-separated --dtype names (default: every one this machine runs)")
    p.add_argument("--tokens", type=int, default=0,
                   help="tokens of the shipped text to score (default 0: all of it)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--json", default=None, help="write results to this JSON file")


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> int:
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer
    from worker import kernels
    from worker.build import add_format, load_model
    from worker.formats import FORMATS, QUALITY_TOLERANCE, Capabilities, kv_dtype
    from worker.quality import greedy, perplexity, text

    source = resolve_model(args.model)
    ops = kernels.load()
    caps = Capabilities.detect(ops, source.kind)
    names = args.formats.split(",") if args.formats else list(FORMATS)
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        print(f"python -m experiments quality: unknown formats {unknown}; choose from {list(FORMATS)}")
        return 2
    runnable = [n for n in names if not caps.missing(FORMATS[n])]
    skipped = {n: caps.missing(FORMATS[n]) for n in names if n not in runnable}
    if "float32" not in runnable:
        runnable.insert(0, "float32")
    lm = load_model(source, ops)
    tok = Tokenizer.from_source(source)
    ids = tok.encode(text())
    if args.tokens:
        ids = ids[: args.tokens]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    results: dict[str, dict[str, Any]] = {}
    ref_top1: torch.Tensor | None = None
    ref_greedy: list[list[int]] = []
    for name in runnable:
        fmt = FORMATS[name]
        t0 = time.perf_counter()
        ws = add_format(lm, fmt, caps)
        kd = kv_dtype(fmt)
        ppl = perplexity(lm, name, ids, kd)
        gen = greedy(lm, name, kd, prompts, args.new_tokens)
        if name == "float32":
            ref_top1, ref_greedy = ppl.top1, gen
        assert ref_top1 is not None
        base = results["float32"]["ppl"] if results else ppl.ppl
        results[name] = {
            "format": name, "matrices": ws.formats(), "weights_mib": round(ws.nbytes() / 2**20, 1),
            "kv_dtype": str(kd).removeprefix("torch."), "ppl": ppl.ppl,
            "ppl_vs_fp32_pct": 100 * (ppl.ppl / base - 1), "tokens": ppl.tokens,
            "passes": ppl.ppl <= base * (1 + QUALITY_TOLERANCE),
            "top1_agreement": float((ppl.top1 == ref_top1).float().mean()),
            "greedy_identical": sum(a == b for a, b in zip(gen, ref_greedy)),
            "greedy_mean_prefix": sum(_prefix(a, b) for a, b in zip(gen, ref_greedy)) / len(gen),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if name != "float32":
            lm.sets.pop(name, None)
        print(f"{name}: done", flush=True)
    keys = ["format", "kv_dtype", "weights_mib", "ppl", "ppl_vs_fp32_pct", "passes",
            "top1_agreement", "greedy_identical", "greedy_mean_prefix"]
    print(f"quality vs float32: {source.name}, {len(ids)} tokens of worker/data/"
          f"alice_ch1-2.txt, {len(prompts)} chat prompts x {args.new_tokens} greedy tokens "
          f"(passes: perplexity within {QUALITY_TOLERANCE:.0%} of float32's)")
    print(table(keys, [[_fmt(r[k]) for k in keys] for r in results.values()]))
    for n, why in skipped.items():
        print(f"not run: {n} ({', '.join(why)})")
    write_json(args.json, {"model": str(source.path), "tokens": len(ids),
                           "prompts": PROMPTS, "new_tokens": args.new_tokens,
                           "tolerance": QUALITY_TOLERANCE, "skipped": skipped,
                           "results": list(results.values())})
    return 0


def _fmt(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v
