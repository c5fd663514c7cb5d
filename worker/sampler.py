"""Batched token sampling: greedy, temperature, top-k, top-p, with repeatable seeds.

* One argmax over the whole batch for the greedy rows.
* For sampled rows, one torch.topk over the batch (K = the largest top_k asked, or
  `CANDIDATES` for top-p-only rows) instead of a sort of the 49k vocabulary per row; a
  top-p-only row whose nucleus is not inside its candidates (a flat distribution) retries
  with 16x more, then sorts its whole row. The result is the full-sort definition's
  (top_k keeps ties with the k-th value; top_p keeps the smallest prefix whose mass
  reaches p, over the top-k set when top_k is set).
* One uniform number per row from a counter-based generator: splitmix64 of
  (seed * 1_000_003 + output_index), then the inverse CDF over the kept tokens. The token
  depends only on the row's logits, its parameters and that key, never on the batch
  around it or on which worker process computed it, so a request with a seed gets the
  same tokens in any batch, after a rotation, a recompute or a worker restart. (It is not
  the token stream of the torch.multinomial sampler this replaced.) Rows without a seed
  draw from one process-wide generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

CANDIDATES = 256
_GLOBAL = np.random.default_rng(0x5EED)


class SamplingRow(Protocol):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    output_index: int


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniforms(rows: Sequence[SamplingRow]) -> np.ndarray:
    """One U[0, 1) per row: a pure function of (seed, output_index) when seed is set."""
    out = np.empty(len(rows), dtype=np.float64)
    keys: list[int] = []
    where: list[int] = []
    for i, r in enumerate(rows):
        if r.seed is None:
            out[i] = _GLOBAL.random()
        else:
            keys.append((r.seed * 1_000_003 + r.output_index) % (1 << 63))
            where.append(i)
    if keys:
        z = _splitmix64(np.asarray(keys, dtype=np.uint64))
        out[where] = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return out


def sample_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """logits: [S, V] fp32, one row per entry of `rows`; returns one token id per row."""
    S, V = logits.shape
    out: list[int] = logits.argmax(dim=-1).tolist()
    temp = np.fromiter((r.temperature for r in rows), dtype=np.float64, count=S)
    topk = np.fromiter((r.top_k for r in rows), dtype=np.int64, count=S)
    samp = np.nonzero((temp != 0.0) & (topk != 1))[0]
    if len(samp) == 0:
        return out
    topp = np.fromiter((r.top_p for r in rows), dtype=np.float64, count=S)[samp]
    k = np.minimum(topk[samp], V)
    x = logits.index_select(0, torch.from_numpy(samp)) / torch.from_numpy(temp[samp]).float()[:, None]
    u = uniforms([rows[i] for i in samp.tolist()])
    picks = np.full(len(samp), -1, dtype=np.int64)
    unfiltered = (k <= 0) & (topp >= 1.0)
    todo = np.nonzero(~unfiltered)[0]
    for cap in (CANDIDATES, 16 * CANDIDATES):
        if len(todo) == 0:
            break
        got = _from_candidates(x[torch.from_numpy(todo)], k[todo], topp[todo], u[todo], min(cap, V))
        ok = got >= 0
        picks[todo[ok]] = got[ok]
        todo = todo[~ok]
    for r in np.nonzero(unfiltered)[0]:
        picks[r] = _sample_row(x[r], 1.0, float(u[r]))
    for r in todo:  # a nucleus wider than every candidate tried: sort the whole row
        picks[r] = _sample_row(x[r], float(topp[r]), float(u[r]))
    for j, i in enumerate(samp.tolist()):
        out[i] = int(picks[j])
    return out


def _from_candidates(x: torch.Tensor, k: np.ndarray, p: np.ndarray, u: np.ndarray,
                     cap: int) -> np.ndarray:
    """x: [n, V] scaled logits. Picks among each row's top candidates; -1 where a
    top-p-only row's nucleus is not inside them."""
    V = x.shape[1]
    top_p_only = (k <= 0) & (p < 1.0)
    Kc = int(min(V, max(int(k.max()), cap if bool(top_p_only.any()) else 1)))
    vals, idx = torch.topk(x, Kc, dim=-1)  # [n, Kc], sorted descending
    kt = torch.from_numpy(k)
    limit = torch.where(kt > 0, kt, Kc)
    kth = vals.gather(1, (limit - 1).clamp_max(Kc - 1)[:, None])
    vals = vals.masked_fill(vals < kth, float("-inf"))  # top_k keeps ties with the k-th
    # the normaliser: over the top-k set when top_k is set, else over the whole row
    lse = torch.where(kt > 0, torch.logsumexp(vals, -1), torch.logsumexp(x, -1))
    probs = torch.exp(vals - lse[:, None])
    csum = probs.cumsum(-1)
    pt = torch.from_numpy(p).float()
    kept = probs.masked_fill((csum - probs) > pt[:, None], 0.0)
    c = kept.cumsum(-1)
    target = torch.from_numpy(u).float() * c[:, -1]
    pos = torch.searchsorted(c, target[:, None], right=True).squeeze(1).clamp_max(Kc - 1)
    picks = idx.gather(1, pos[:, None]).squeeze(1).numpy().copy()
    picks[torch.from_numpy(top_p_only).numpy() & (csum[:, -1] <= pt).numpy()] = -1
    return picks


def _sample_row(x: torch.Tensor, top_p: float, u: float) -> int:
    """One row by the whole vocabulary. Without a filter: the inverse CDF in vocabulary
    order (no sort needed; the same distribution)."""
    if top_p >= 1.0:
        c = torch.softmax(x, -1).cumsum(-1)
        j = torch.searchsorted(c, torch.tensor([u * float(c[-1])]), right=True)
        return int(j.clamp_max(x.shape[0] - 1))
    sx, idx = torch.sort(x, descending=True)
    probs = torch.softmax(sx, -1)
    kept = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
    c = kept.cumsum(-1)
    j = torch.searchsorted(c, torch.tensor([u * float(c[-1])]), right=True)
    return int(idx[int(j.clamp_max(x.shape[0] - 1))])
