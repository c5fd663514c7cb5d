"""Token sampling: greedy, temperature, top-k, top-p, with repeatable per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

_GLOBAL = torch.Generator().manual_seed(0x5EED)


class SamplingRow(Protocol):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    output_index: int


def _generator(row: SamplingRow) -> torch.Generator:
    if row.seed is None:
        return _GLOBAL
    # One stream per (seed, step): the same request and seed give the same tokens no matter
    # which batch, iteration or worker process computes them.
    return torch.Generator().manual_seed((row.seed * 1_000_003 + row.output_index) % (1 << 63))


def sample_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """logits: [S, V] fp32, one row per entry of `rows`; returns one token id per row."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, row in enumerate(rows):
        if row.temperature == 0.0 or row.top_k == 1:
            out.append(int(greedy[i]))
            continue
        x = logits[i] / row.temperature
        if row.top_k > 0:
            k = min(row.top_k, x.shape[-1])
            kth = torch.topk(x, k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if row.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = probs.cumsum(-1) - probs > row.top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
        probs = torch.softmax(x, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=_generator(row)).item()))
    return out
