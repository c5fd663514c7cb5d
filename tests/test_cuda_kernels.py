"""The CUDA path's Triton kernels against torch, on small shapes (worker/cuda/kernels.py).

Without a GPU they run under Triton's interpreter on CPU tensors (tests/conftest.py turns it
on); with one, the same tests run the compiled kernels on CUDA tensors. The paged attention
kernel reads one layer's strided view of a block-first pool, `pool[:, layer, 0/1]`, through
block tables that are non-contiguous, share prefix blocks, and end in a partly filled block;
decode rows, fresh prompt chunks and chunks over a cached prefix share one launch.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and Triton's interpreter is off", allow_module_level=True)

from worker.cuda.kernels import (  # noqa: E402
    decode_splits,
    paged_attention,
    paged_decode_attention,
    rms_norm,
    rope_and_cache,
    silu_mul,
)

# (q_len, start): a decode is q_len 1; start 0 with q_len > 1 is a fresh prompt chunk.
Seq = tuple[int, int]


def make_tables(rng: random.Random, seqs: list[Seq], block_size: int, num_blocks: int,
                shared_prefix: int = 0) -> list[list[int]]:
    """Random, scattered block tables; the first `shared_prefix` blocks of every sequence
    that is long enough are the same blocks (a shared prompt prefix)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared_prefix)]
    tables = []
    for q_len, start in seqs:
        need = math.ceil((start + q_len) / block_size)
        own = [free.pop() for _ in range(max(0, need - len(common)))]
        tables.append((common + own)[:need] if need > len(common) else common[:need])
    return tables


def reference(q: torch.Tensor, pool: torch.Tensor, layer: int, seqs: list[Seq],
              tables: list[list[int]], scale: float) -> torch.Tensor:
    """Per sequence: gather its context from the pool, causal SDPA with the offset."""
    out = torch.zeros_like(q, dtype=torch.float32)
    hkv, hd = pool.shape[4], pool.shape[5]
    q0 = 0
    for (n, start), table in zip(seqs, tables, strict=True):
        ctx = start + n
        b = torch.tensor(table, device=pool.device)
        k = pool[b, layer, 0].reshape(-1, hkv, hd)[:ctx].float()
        v = pool[b, layer, 1].reshape(-1, hkv, hd)[:ctx].float()
        pos = torch.arange(ctx, device=pool.device)
        mask = pos[None, :] <= (start + torch.arange(n, device=pool.device))[:, None]
        o = F.scaled_dot_product_attention(
            q[q0:q0 + n].float().transpose(0, 1)[None], k.transpose(0, 1)[None],
            v.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        out[q0:q0 + n] = o[0].transpose(0, 1)
        q0 += n
    return out


def run_kernel(q: torch.Tensor, pool: torch.Tensor, layer: int, seqs: list[Seq],
               tables: list[list[int]], scale: float, **kw: int) -> torch.Tensor:
    width = max(len(t) for t in tables) + 2  # wider than needed: padding must not be read
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    lens = [n for n, _ in seqs]
    starts = [0, *itertools_accumulate(lens)][:-1]
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return paged_attention(q, pool[:, layer, 0], pool[:, layer, 1], bt.to(DEVICE),
                           as_i32(starts), as_i32(lens), as_i32([s for _, s in seqs]),
                           max(lens), scale, **kw)


def itertools_accumulate(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


CASES = {
    # name: (Hq, Hkv, head_dim, block_size, seqs, shared prefix blocks)
    "decode_gqa2": (4, 2, 16, 4, [(1, 0), (1, 3), (1, 4), (1, 11), (1, 22)], 0),
    "decode_shared_prefix": (4, 2, 16, 4, [(1, 9), (1, 13), (1, 8)], 2),
    "decode_gqa3_partial_blocks": (6, 2, 32, 8, [(1, 5), (1, 17), (1, 30)], 0),
    "decode_mha": (2, 2, 16, 4, [(1, 6), (1, 1)], 0),
    "prefill_over_cached_prefix": (4, 2, 16, 4, [(5, 7), (9, 4), (3, 0)], 0),
    "mixed_batch_shared_prefix": (6, 2, 16, 4, [(1, 14), (6, 8), (1, 9), (11, 0), (2, 13)], 2),
    "head_dim_not_a_power_of_two": (4, 1, 24, 4, [(3, 5), (1, 10)], 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_sdpa(case: str) -> None:
    hq, hkv, hd, bs, seqs, shared = CASES[case]
    rng = random.Random(case)
    torch.manual_seed(len(case))
    num_blocks, layers, layer = 24, 3, 1  # the middle layer: a strided view, not the start
    tables = make_tables(rng, seqs, bs, num_blocks, shared)
    pool = torch.randn(num_blocks, layers, 2, bs, hkv, hd, device=DEVICE)
    q = torch.randn(sum(n for n, _ in seqs), hq, hd, device=DEVICE)
    scale = hd ** -0.5
    want = reference(q, pool, layer, seqs, tables, scale)
    got = run_kernel(q, pool, layer, seqs, tables, scale, block_m=16, block_n=16)
    err = (got - want).abs().max().item()
    print(f"{case}: max |kernel - SDPA| = {err:.2e}")
    assert err < 2e-5


def test_paged_attention_bf16_pool() -> None:
    """bf16 pool and queries (the GPU's dtype): within bf16 rounding of an fp32 SDPA."""
    hq, hkv, hd, bs = 4, 2, 16, 4
    seqs = [(1, 9), (4, 6), (1, 2)]
    tables = make_tables(random.Random(1), seqs, bs, 16)
    pool = torch.randn(16, 2, 2, bs, hkv, hd, device=DEVICE).bfloat16()
    q = torch.randn(6, hq, hd, device=DEVICE).bfloat16()
    want = reference(q, pool, 0, seqs, tables, 0.25)
    got = run_kernel(q, pool, 0, seqs, tables, 0.25, block_m=16, block_n=16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() < 2e-2


def test_paged_attention_default_tiles_and_block_sizes() -> None:
    """The tile sizes the GPU uses (BLOCK_N 64 > block_size, BLOCK_M 64 for prefill)."""
    hq, hkv, hd, bs = 8, 2, 16, 16
    seqs = [(1, 70), (20, 50), (1, 3)]
    tables = make_tables(random.Random(2), seqs, bs, 16)
    pool = torch.randn(16, 1, 2, bs, hkv, hd, device=DEVICE)
    q = torch.randn(22, hq, hd, device=DEVICE)
    want = reference(q, pool, 0, seqs, tables, 0.3)
    assert (run_kernel(q, pool, 0, seqs, tables, 0.3) - want).abs().max().item() < 2e-5


def test_rms_norm_with_and_without_residual() -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 48, device=DEVICE)
    r = torch.randn(5, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)

    def ref(v: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    y, res = rms_norm(x, w, 1e-5)
    assert torch.allclose(y, ref(x), atol=1e-5) and torch.equal(res, x)
    want_res = x + r
    y, res = rms_norm(x, w, 1e-5, residual=r.clone())
    assert torch.allclose(res, want_res) and torch.allclose(y, ref(want_res), atol=1e-5)


def test_rope_and_cache_rotates_q_k_and_writes_the_pool_slots() -> None:
    torch.manual_seed(4)
    hq, hkv, hd, bs, T = 4, 2, 16, 4, 6
    pool = torch.zeros(8, 2, 2, bs, hkv, hd, device=DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * hd, device=DEVICE)
    positions = torch.tensor([0, 1, 2, 9, 30, 5], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([3 * bs + 0, 3 * bs + 1, 3 * bs + 2, 6 * bs + 1, -1, 0 * bs + 3],
                         dtype=torch.int32, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv).to(DEVICE)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    q = rope_and_cache(qkv, cos, sin, positions, slots, pool[:, 1, 0], pool[:, 1, 1], hq, hkv)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, H, hd], rotate-half
        c, s = cos[positions.long()][:, None], sin[positions.long()][:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    want_q = rope(qkv[:, : hq * hd].view(T, hq, hd))
    want_k = rope(qkv[:, hq * hd:(hq + hkv) * hd].view(T, hkv, hd))
    want_v = qkv[:, (hq + hkv) * hd:].view(T, hkv, hd)
    assert torch.allclose(q, want_q, atol=1e-5)
    written = torch.zeros_like(pool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # the padded row (-1) writes nothing
            written[slot // bs, 1, 0, slot % bs] = want_k[t]
            written[slot // bs, 1, 1, slot % bs] = want_v[t]
    assert torch.allclose(pool, written, atol=1e-5)  # layer 0 and other slots untouched


def test_silu_mul() -> None:
    torch.manual_seed(5)
    gu = torch.randn(3, 2 * 40, device=DEVICE)
    want = F.silu(gu[:, :40]) * gu[:, 40:]
    assert torch.allclose(silu_mul(gu, block=16), want, atol=1e-6)


SPLIT_CASES = {
    # name: (Hq, Hkv, head_dim, block_size, decode starts, shared prefix blocks, splits)
    "two_splits_gqa2": (4, 2, 16, 4, [0, 3, 40, 71], 0, 2),
    "four_splits_gqa3_partial_blocks": (6, 2, 32, 8, [5, 17, 150], 0, 4),
    "eight_splits_shared_prefix_short_rows": (4, 1, 16, 4, [2, 60, 33, 130], 3, 8),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_decode_attention_matches_sdpa(case: str) -> None:
    """Flash-decoding: the context split over programs, partials combined; splits that get
    no key at all (short rows) must weigh nothing. Rows sit at arbitrary q_start."""
    hq, hkv, hd, bs, starts, shared, splits = SPLIT_CASES[case]
    rng = random.Random(case)
    torch.manual_seed(len(case))
    seqs = [(1, st) for st in starts]
    num_blocks = 96
    tables = make_tables(rng, seqs, bs, num_blocks, shared)
    pool = torch.randn(num_blocks, 2, 2, bs, hkv, hd, device=DEVICE)
    q = torch.randn(len(seqs), hq, hd, device=DEVICE)
    want = reference(q, pool, 1, seqs, tables, hd ** -0.5)
    bt = torch.zeros(len(seqs), max(map(len, tables)) + 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    got = paged_decode_attention(q, pool[:, 1, 0], pool[:, 1, 1], bt.to(DEVICE),
                                 as_i32(list(range(len(seqs)))), as_i32(starts), hd ** -0.5,
                                 splits, block_n=16)
    err = (got - want).abs().max().item()
    print(f"{case}: max |split kernel - SDPA| = {err:.2e}")
    assert err < 2e-5


def test_decode_splits_fill_the_gpu_only_while_it_is_empty() -> None:
    assert decode_splits(1, 8, 64, 16) == 16  # batch 1 of the 8B shape: 8 programs alone
    assert decode_splits(32, 8, 64, 16) == 2  # 256 programs: twice 132 SMs with 2
    assert decode_splits(256, 8, 64, 16) == 1  # 2048 programs already
    assert decode_splits(1, 8, 1, 16) == 1  # one key tile: nothing to split
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(torch.zeros(1, 2, 16), torch.zeros(1, 4, 2, 16),
                               torch.zeros(1, 4, 2, 16), torch.zeros(1, 1, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), 1.0, 3)
