"""`python -m experiments grammar`: what a structured-output mask costs per token.

Two measurements on the bundled model, one process:

* the mask alone: for B matchers of one JSON schema advanced along a real output, the
  time to fill their token bitmasks (llguidance, in parallel) and apply them to a [B, V]
  logits tensor (`worker/logits_processing.apply_token_mask`), per row and token;
* the engine: B requests with the schema and B free ones (greedy, same prompts, same
  number of tokens: the free ones are capped at the constrained ones' lengths), run in
  turn `--repeats` times; the time per generated token of each and their ratio.

Wrap it in `flock /work/bench.lock` on a shared machine; it reports ratios measured in the
same run, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from common.config import EngineConfig
from common.contracts import Grammar
from scheduler_svc.request import SamplingParams
from superinfer.bench.report import table, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=16, help="requests per side")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="constrained/free pairs")
    p.add_argument("--json", default=None)


def _mask_alone(engine: Any, grammar: Grammar, outputs: list[list[int]]) -> dict[str, float]:
    from worker.grammar import GrammarBank
    from worker.logits_processing import apply_token_mask

    vocab = engine.runner.config.vocab_size
    bank = GrammarBank(engine.tokenizer, vocab)
    matchers = [bank.matcher(grammar) for _ in outputs]
    steps = min(len(o) for o in outputs)
    logits = torch.randn(len(outputs), vocab)
    rows = torch.arange(len(outputs))
    fill = apply = 0.0
    for t in range(steps):
        t0 = time.perf_counter()
        mask = bank.bitmask(matchers)
        t1 = time.perf_counter()
        apply_token_mask(logits, rows, mask)
        t2 = time.perf_counter()
        fill += t1 - t0
        apply += t2 - t1
        for m, o in zip(matchers, outputs, strict=True):
            m.consume_tokens([o[t]])
    n = steps * len(outputs)
    return {"rows": float(len(outputs)), "steps": float(steps),
            "fill_ms_per_row_token": 1e3 * fill / n, "apply_ms_per_row_token": 1e3 * apply / n,
            "mask_ms_per_step": 1e3 * (fill + apply) / steps}


def run(args: argparse.Namespace) -> int:
    from superinfer.engine import LLMEngine

    engine = LLMEngine(EngineConfig(device_blocks=1024, host_blocks=0))
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    prompts = [engine.encode_prompt(f"Invent person {i} as JSON.", chat=True)
               for i in range(args.batch)]
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=grammar)
    res = engine.generate(prompts, constrained)  # warm: compiles the schema once
    lengths = [len(r.token_ids) for r in res]
    mask = _mask_alone(engine, grammar, [r.token_ids for r in res])
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"constrained": [], "free": []}
    for _ in range(args.repeats):
        for side, params in (("constrained", [constrained] * len(prompts)), ("free", free)):
            t0 = time.perf_counter()
            out = engine.generate(prompts, params)
            dt = time.perf_counter() - t0
            times[side].append(dt / sum(len(r.token_ids) for r in out))
    ratios = [c / f for c, f in zip(times["constrained"], times["free"], strict=True)]
    result = {
        "batch": args.batch, "tokens": sum(lengths), "mask_alone": mask,
        "ms_per_token": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "ratio_constrained_over_free": statistics.median(ratios), "ratios": ratios,
    }
    print(table(["what", "value"], [
        ["mask fill, ms per row-token", mask["fill_ms_per_row_token"]],
        ["mask apply, ms per row-token", mask["apply_ms_per_row_token"]],
        [f"mask per step of {args.batch} rows, ms", mask["mask_ms_per_step"]],
        ["engine, constrained, ms per token", result["ms_per_token"]["constrained"]],
        ["engine, free, ms per token", result["ms_per_token"]["free"]],
        ["constrained / free (median of pairs)", result["ratio_constrained_over_free"]],
    ]))
    write_json(args.json, result)
    return 0
