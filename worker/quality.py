"""How close a weight set stays to float32: perplexity on a shipped public-domain text.

The text is chapters I-II of *Alice's Adventures in Wonderland* (worker/data/README.md
says where it came from and why it is public domain). Perplexity runs the text in windows
of `WINDOW` tokens, each window in chunks of `CHUNK` (the first chunk a fresh prefill,
the rest reading the pool, so both attention paths count), on a private KV pool.

`greedy` generates for a batch of prompts (worker/agreement.py compares formats with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.contracts import ScheduledChunk
from worker.attention import build_meta
from worker.model import LlamaModel

TEXT_PATH = Path(__file__).resolve().parent / "data" / "alice_ch1-2.txt"
WINDOW = 512
CHUNK = 256
BLOCK = 16


def text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


@dataclass(slots=True)
class Perplexity:
    ppl: float
    tokens: int  # predicted tokens
    top1: torch.Tensor  # [tokens] argmax prediction at each position (agreement checks)


def private_pool(model: LlamaModel, dtype: torch.dtype, tokens: int = WINDOW) -> torch.Tensor:
    cfg = model.cfg
    blocks = -(-tokens // BLOCK) + 1  # block 0 stays unused
    return torch.zeros((blocks, cfg.num_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim),
                       dtype=dtype)


def window_logits(model: LlamaModel, weights: str, kv: torch.Tensor,
                  ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of one window, computed in chunks of CHUNK tokens."""
    table = list(range(1, -(-len(ids) // BLOCK) + 1))
    out = []
    for s in range(0, len(ids), CHUNK):
        part = ids[s: s + CHUNK]
        chunk = ScheduledChunk("ppl", part, s, table[: -(-(s + len(part)) // BLOCK)], True)
        out.append(model.forward(weights, build_meta([chunk], BLOCK, all_logits=True), kv))
    return torch.cat(out)


def perplexity(model: LlamaModel, weights: str, ids: list[int], kv_dtype: torch.dtype
               ) -> Perplexity:
    kv = private_pool(model, kv_dtype)
    nll, n, tops = 0.0, 0, []
    for i in range(0, len(ids) - 1, WINDOW):
        w = ids[i: i + WINDOW]
        if len(w) < 2:
            continue
        lg = window_logits(model, weights, kv, w)[:-1]
        nll += F.cross_entropy(lg, torch.tensor(w[1:]), reduction="sum").item()
        n += len(w) - 1
        tops.append(lg.argmax(-1))
    if n == 0:
        raise ValueError("perplexity needs at least two tokens")
    return Perplexity(math.exp(nll / n), n, torch.cat(tops))


def greedy(model: LlamaModel, weights: str, kv_dtype: torch.dtype, prompts: list[list[int]],
           new: int) -> list[list[int]]:
    """`new` greedy tokens of every prompt, the prompts batched together (each prompt one
    prefill chunk, then one decode row per prompt per step), on a private pool."""
    per = -(-(max(len(p) for p in prompts) + new) // BLOCK)
    kv = private_pool(model, kv_dtype, per * BLOCK * len(prompts))
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    chunks = [ScheduledChunk(f"g{i}", list(p), 0, tables[i], True) for i, p in enumerate(prompts)]
    for _ in range(new):
        logits = model.forward(weights, build_meta(chunks, BLOCK), kv)
        toks = logits.argmax(-1).tolist()
        for i, t in enumerate(toks):
            outs[i].append(int(t))
            seqs[i].append(int(t))
        chunks = [ScheduledChunk(f"g{i}", [s[-1]], len(s) - 1, tables[i], True)
                  for i, s in enumerate(seqs)]
    return outs
