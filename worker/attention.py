"""A batch's metadata, built once per step, and attention over the block-first KV pool.

The pool is kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]. A query
row t attends to positions [0, ctx[t]) of the sequence whose block table is
tables[qrow[t]]: one description for decode rows (ctx = position + 1) and for prefill
chunks with a cached prefix (each row its own causal limit). The C++ kernel
(csrc/attention.cpp) walks the block table and reads K/V where they lie, one (row, KV
head) at a time in a fixed order: a row's result does not depend on the batch, on how its
prompt was chunked, or on whether it is a decode step or a recompute. That is what makes
a recomputed request (fcfs preemption, a worker restart) continue exactly as it would
have, in every format. `build_meta(..., sdpa_fresh=True)` instead sends fresh prompt
chunks (start 0, at least `SDPA_MIN_LEN` tokens) through SDPA on their own fp32 K/V: a
blocked GEMM, faster for long prompts, but it rounds differently from the pool's copy
(bf16 with quantized weights), so a recompute could drift from the original decode; it is
off by default (`SDPA_FRESH`).

`TorchAttention` is the path without the C++ kernels: per layer one index_select gather of
every chunk's blocks, masks built once per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common.contracts import ScheduledChunk

SDPA_FRESH = False  # see the module docstring: exactness across recompute first
SDPA_MIN_LEN = 16  # with sdpa_fresh, fresh chunks shorter than this attend through the pool


@dataclass(slots=True)
class PagedMeta:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_blocks: torch.Tensor  # [T] int64: the block each token's K/V is written to
    slot_offsets: torch.Tensor  # [T] int64: ... and the offset in it
    tables: torch.Tensor  # [R, max_blocks] int32, one row per chunk (0-padded)
    qrow: torch.Tensor  # [T] int32: table row of each token
    ctx: torch.Tensor  # [T] int32: keys each token attends to (position + 1)
    paged_idx: torch.Tensor  # [n] int32: rows that attend through the pool
    fresh: list[int]  # (start, len, start, len, ...) of fresh chunks attended with SDPA
    logits_index: torch.Tensor  # [S] int64: rows whose logits are returned
    chunk_starts: np.ndarray  # [R] first row of each chunk
    chunk_lens: np.ndarray  # [R]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_meta(chunks: Sequence[ScheduledChunk], block_size: int, sdpa_fresh: bool = SDPA_FRESH,
               all_logits: bool = False) -> PagedMeta:
    """Vectorized batch description (numpy; no per-token Python loop). `all_logits`:
    every row's logits (perplexity), not only the sampled rows'."""
    R = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=R)
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=R)
    T = int(lens.sum())
    first = np.zeros(R, dtype=np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    if T == R:  # pure decode: one token per chunk
        ids = [c.token_ids[0] for c in chunks]
        qrow = np.arange(R, dtype=np.int64)
        pos = starts
    else:
        ids = [x for c in chunks for x in c.token_ids]
        qrow = np.repeat(np.arange(R, dtype=np.int64), lens)
        pos = np.arange(T, dtype=np.int64) - first[qrow] + starts[qrow]
    nb = max(len(c.block_table) for c in chunks)
    tab = np.zeros((R, nb), dtype=np.int32)
    for i, c in enumerate(chunks):
        tab[i, : len(c.block_table)] = c.block_table
    blk = tab[qrow, pos // block_size].astype(np.int64)
    paged = np.ones(T, dtype=bool)
    fresh: list[int] = []
    if sdpa_fresh:
        for i in np.nonzero((starts == 0) & (lens >= SDPA_MIN_LEN))[0].tolist():
            s, n = int(first[i]), int(lens[i])
            fresh += [s, n]
            paged[s: s + n] = False
    if all_logits:
        logits = np.arange(T, dtype=np.int64)
    else:
        sample = np.fromiter((c.sample for c in chunks), dtype=bool, count=R)
        drafts = np.fromiter((c.num_draft for c in chunks), dtype=np.int64, count=R)
        # A speculative chunk samples at its last known token, before its drafts.
        logits = (first + lens - 1 - drafts)[sample]
        # Echo: after the sampled rows, every row whose prompt logprob is asked for.
        extra = [np.arange(first[i], first[i] + len(c.prompt_logprob_targets), dtype=np.int64)
                 for i, c in enumerate(chunks) if c.prompt_logprob_targets]
        # Then each speculative chunk's draft rows, which verify it (logits_processing.py).
        extra += [np.arange(first[i] + lens[i] - c.num_draft, first[i] + lens[i], dtype=np.int64)
                  for i, c in enumerate(chunks) if c.num_draft]
        if extra:
            logits = np.concatenate([logits, *extra])
    return PagedMeta(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.from_numpy(np.ascontiguousarray(pos)),
        slot_blocks=torch.from_numpy(blk),
        slot_offsets=torch.from_numpy(np.ascontiguousarray(pos % block_size)),
        tables=torch.from_numpy(tab),
        qrow=torch.from_numpy(qrow.astype(np.int32)),
        ctx=torch.from_numpy((pos + 1).astype(np.int32)),
        paged_idx=torch.from_numpy(np.nonzero(paged)[0].astype(np.int32)),
        fresh=fresh,
        logits_index=torch.from_numpy(np.ascontiguousarray(logits)),
        chunk_starts=first,
        chunk_lens=lens,
    )


def sdpa_fresh(qkv: torch.Tensor, out: torch.Tensor, fresh: list[int], hq: int, hkv: int,
               hd: int, scale: float) -> None:
    """Causal attention of each fresh chunk over its own K/V (rows of qkv, after RoPE)."""
    for i in range(0, len(fresh), 2):
        s, n = fresh[i], fresh[i + 1]
        seg = qkv[s: s + n]
        q = seg[:, : hq * hd].view(n, hq, hd).transpose(0, 1)[None]  # [1, Hq, n, hd]
        k = seg[:, hq * hd: (hq + hkv) * hd].view(n, hkv, hd).transpose(0, 1)[None]
        v = seg[:, (hq + hkv) * hd:].view(n, hkv, hd).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[s: s + n] = o[0].transpose(0, 1).reshape(n, hq * hd)


class TorchAttention:
    """Attention without the C++ kernels, for rows in meta.paged_idx. Per batch: a key mask
    [R1, 1, 1, L] for the single-token chunks and a causal mask per longer chunk; per
    layer: one gather of every chunk's blocks."""

    def __init__(self, meta: PagedMeta, kv: torch.Tensor, scale: float) -> None:
        self.meta = meta
        self.scale = scale
        bs = kv.shape[3]
        self.flat = meta.tables.reshape(-1).long()
        self.R, nb = meta.tables.shape
        self.L = nb * bs
        keys = torch.arange(self.L)
        ctx = meta.ctx.long()
        paged = np.zeros(meta.num_tokens, dtype=bool)
        paged[meta.paged_idx.numpy()] = True
        one = np.nonzero(meta.chunk_lens == 1)[0]
        self.dec = torch.from_numpy(one)
        self.dec_rows = torch.from_numpy(meta.chunk_starts[one])
        self.dec_mask = (keys[None, :] < ctx[self.dec_rows][:, None])[:, None, None, :]
        self.multi: list[tuple[int, int, int, torch.Tensor]] = []  # chunk, start, len, mask
        for i in np.nonzero(meta.chunk_lens > 1)[0]:
            s, n = int(meta.chunk_starts[i]), int(meta.chunk_lens[i])
            if paged[s]:
                mask = (keys[None, :] < ctx[s: s + n][:, None])[None, None]  # [1, 1, n, L]
                self.multi.append((int(i), s, n, mask))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, kv: torch.Tensor, layer: int) -> None:
        # q, out: [T, Hq, hd]
        hkv, hd = kv.shape[4], kv.shape[5]
        grp = q.shape[1] // hkv
        kvl = kv[:, layer].index_select(0, self.flat)  # [R * nb, 2, bs, Hkv, hd]
        kvl = kvl.view(self.R, -1, 2, kv.shape[3], hkv, hd).transpose(1, 2).reshape(
            self.R, 2, self.L, hkv, hd)
        k = kvl[:, 0].transpose(1, 2).to(q.dtype)  # [R, Hkv, L, hd]
        v = kvl[:, 1].transpose(1, 2).to(q.dtype)
        if len(self.dec):
            qq = q[self.dec_rows].view(-1, hkv, grp, hd)  # heads sharing a KV head as rows
            o = F.scaled_dot_product_attention(qq, k[self.dec], v[self.dec],
                                               attn_mask=self.dec_mask, scale=self.scale)
            out[self.dec_rows] = o.reshape(-1, hkv * grp, hd)
        for i, s, n, mask in self.multi:
            # [n, Hq, hd] -> [1, Hkv, grp * n, hd], rows ordered (head in group, position)
            qq = q[s: s + n].view(n, hkv, grp, hd).permute(1, 2, 0, 3).reshape(1, hkv, grp * n, hd)
            o = F.scaled_dot_product_attention(qq, k[i: i + 1], v[i: i + 1],
                                               attn_mask=mask.repeat(1, 1, grp, 1),
                                               scale=self.scale)
            out[s: s + n] = o.view(hkv, grp, n, hd).permute(2, 0, 1, 3).reshape(n, hkv * grp, hd)
