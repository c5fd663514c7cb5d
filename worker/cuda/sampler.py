"""Sampling on the device: greedy, temperature, top-k, top-p, for a whole batch at once.

The contract is the CPU sampler's (worker/sampler.py): with a seed, the token drawn for a
request's output_index depends only on (seed, output_index) and the logits — not on the
batch, the iteration or the worker process. The way there differs: instead of one
torch.Generator per row, each row draws by the Gumbel-max trick, argmax(logits / T + G),
with G = -log(-log(U)) and U a counter-based hash of (seed * 1_000_003 + output_index,
token id). That is an exact sample from softmax(logits / T) restricted to the top-k /
top-p set, computed for every row in a few batched ops with no generator objects and no
host round trip but the final token ids. Seeded tokens therefore differ between the CPU
and the GPU worker (another random stream), and are repeatable on each.

The hash is integer arithmetic in int64 that never overflows (32-bit halves), so it gives
the same bits on any device; it runs on CPU tensors in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

_M32 = 0xFFFFFFFF
_UNSEEDED = torch.Generator().manual_seed(0x5EED)
SEED_STRIDE = 1_000_003  # the CPU sampler's key: seed * SEED_STRIDE + output_index


class SamplingRow(Protocol):  # a ScheduledChunk has these
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    output_index: int


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """U in (0, 1), [len(keys), vocab] fp32, a pure function of (key, token id).

    keys: [R] int64 in [0, 2**63)."""
    lo = (keys & _M32)[:, None]
    hi = (keys >> 32)[:, None]
    tok = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]
    h = _mix32(_mix32(_mix32(tok ^ 0x9E3779B9) ^ hi) ^ lo)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def row_keys(rows: Sequence[SamplingRow]) -> list[int]:
    keys = []
    for r in rows:
        if r.seed is None:  # unseeded: any fresh key
            keys.append(int(torch.randint(0, 1 << 62, (1,), generator=_UNSEEDED)))
        else:
            keys.append((r.seed * SEED_STRIDE + r.output_index) % (1 << 63))
    return keys


def sample_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """logits: [S, V] fp32 on any device, one row per entry of `rows`; one token id each."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not (r.temperature == 0.0 or r.top_k == 1)]
    if not random_rows:
        return greedy.tolist()
    dev = logits.device
    sel = [rows[i] for i in random_rows]
    idx = torch.tensor(random_rows, device=dev)
    x = logits.index_select(0, idx)
    V = x.shape[1]
    temp = torch.tensor([r.temperature for r in sel], device=dev, dtype=torch.float32)
    x = x / temp[:, None]
    top_k = [min(r.top_k, V) if r.top_k > 0 else 0 for r in sel]
    if any(top_k):
        kmax = max(top_k)
        vals = torch.topk(x, kmax, dim=-1).values  # [R, kmax], descending
        k_idx = torch.tensor([k - 1 if k else kmax - 1 for k in top_k], device=dev)
        kth = vals.gather(1, k_idx[:, None])
        limit = torch.tensor([bool(k) for k in top_k], device=dev)[:, None]
        x = x.masked_fill(limit & (x < kth), float("-inf"))
    top_p = torch.tensor([r.top_p for r in sel], device=dev, dtype=torch.float32)
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (probs.cumsum(-1) - probs) > top_p[:, None]
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    keys = torch.tensor(row_keys(sel), device=dev, dtype=torch.int64)
    gumbel = -torch.log(-torch.log(uniform(keys, V)))
    drawn = (x + gumbel).argmax(dim=-1)
    out = greedy.clone()
    out[idx] = drawn
    return out.tolist()
