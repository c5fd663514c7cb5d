"""The Triton kernels of the CUDA forward pass (worker/cuda/model.py).

Triton rather than FlashInfer or FlashAttention's paged path: a Triton kernel also runs
under Triton's interpreter on CPU tensors, so the same source that is compiled on the GPU
is checked against torch on the development machine (tests/test_cuda_kernels.py), and it
reads the block-first pool in place with whatever strides it has. On CUDA tensors the
kernels are compiled; on CPU tensors they run only under the interpreter, which Triton
switches on for the whole process when TRITON_INTERPRET=1 is set before it is imported
(tests/conftest.py sets it on machines without a GPU). The interpreter is slow: CPU use is
for tests with small shapes, never for serving.

* `paged_attention` — varlen attention over the paged KV cache: every sequence of the flat
  batch (a decode token, a fresh prompt chunk or a chunk over a cached prefix) attends to
  positions [0, start + its own position] of its context, reading K and V of one layer
  through its block table from `pool[:, layer, 0]` / `pool[:, layer, 1]` with their
  block-first strides. Query heads that share a KV head are folded into the rows of one
  program (grouped-query attention without copies of K/V).
* `rms_norm` — residual add fused with RMSNorm.
* `rope_and_cache` — rotary embedding of q and k, and the write of k and v into the pool.
* `silu_mul` — SwiGLU's gate.

The compiled path has not run on a GPU yet (no GPU on the machine this was written on);
the interpreted path is what the CPU tests check.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl


def _launcher(kernel: Any, device: torch.device) -> Any:
    """The kernel, after checking it can run on tensors of `device`."""
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interpreted:
        raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no Triton path for {device.type} tensors")
    return kernel


# -- paged attention ------------------------------------------------------------------------
@triton.jit
def _paged_attention(
    Q, K, V, OUT, BT, QSTART, QLEN, CTXSTART,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    head_dim, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    q_len = tl.load(QLEN + seq)
    q0 = tl.load(QSTART + seq)
    start = tl.load(CTXSTART + seq)
    # Row r of this program: query position g // GROUP, query head kvh * GROUP + g % GROUP.
    g = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    qpos = g // GROUP
    head = kvh * GROUP + g % GROUP
    row_ok = qpos < q_len
    d = tl.arange(0, HEAD_DIM)
    d_ok = d < head_dim
    q_ptr = Q + (q0 + qpos)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Keys this program needs: up to the last query position its rows hold (causal).
    last = tl.minimum(q_len, ((mb + 1) * BLOCK_M - 1) // GROUP + 1)
    kv_end = tl.where(mb * BLOCK_M < q_len * GROUP, start + last, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_end
        # int64: block * block stride passes 2**31 elements in a pool of tens of GiB.
        blk = tl.load(BT + seq * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:  # the interpreter's tl.dot is wrong for bf16: same products in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s = s * qk_scale  # [M, N], in log2 units
        valid = (kpos[None, :] <= (start + qpos)[:, None]) & k_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0)
        pr = p.to(v.dtype)  # P rounded to the cache's dtype, as on the GPU's tensor cores
        if UPCAST:
            pv = tl.dot(pr.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr, v, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = OUT + (q0 + qpos)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
    ctx_start: torch.Tensor, max_q_len: int, scale: float, out: torch.Tensor | None = None,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of a flat batch over the paged cache of one layer.

    q: [T, Hq, D]; k_cache, v_cache: one layer's view of the pool, [num_blocks, block_size,
    Hkv, D] with any block/token/head strides (last dim contiguous), e.g. `pool[:, l, 0]`.
    Sequence i's queries are rows [q_start[i], q_start[i] + q_len[i]) of q, at positions
    ctx_start[i] + j; its K/V for positions [0, ctx_start[i] + q_len[i]) must already be in
    the cache, found through block_tables[i] (int32, [S, W]). Returns [T, Hq, D].
    `max_q_len` (a Python int) sizes the grid, so the launch needs no device->host read.
    block_m/block_n/num_warps/num_stages override the tiles and launch (None: the defaults
    below, not yet tuned on a GPU; `superinfer bench gpu-worker --parts attention` times them).
    """
    T, hq, hd = q.shape
    _, bs, hkv, _ = k_cache.shape
    if hq % hkv or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q heads must be a multiple of kv heads; last dims contiguous")
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    S = block_tables.shape[0]
    if S == 0 or T == 0:
        return out
    decode = max_q_len == 1
    bm = block_m or max(16, triton.next_power_of_2(group) if decode else 64)
    bn = block_n or 64
    grid = (S, hkv, triton.cdiv(max_q_len * group, bm))
    kernel = _launcher(_paged_attention, q.device)
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_start, q_len, ctx_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        hd, scale * math.log2(math.e),
        GROUP=group, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=max(16, triton.next_power_of_2(hd)),
        BLOCK_SIZE=bs, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu" and q.dtype != torch.float32,
        **({"num_warps": num_warps} if num_warps else {}),
        **({"num_stages": num_stages} if num_stages else {}),
    )
    return out


# -- decode attention split over the context (flash-decoding) ----------------------------------
@triton.jit
def _paged_decode_split(
    Q, K, V, PART, ML, BT, QSTART, CTXSTART,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, head_dim, qk_scale,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # One decode query per sequence; program (seq, kv head, split) covers keys [lo, hi).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(QSTART + seq)
    kv_len = tl.load(CTXSTART + seq) + 1
    per = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, kv_len)
    g = tl.arange(0, BLOCK_M)
    head = kvh * GROUP + g
    row_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    d_ok = d < head_dim
    q = tl.load(Q + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        blk = tl.load(BT + seq * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s = tl.where(k_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0)
        pr = p.to(v.dtype)
        if UPCAST:
            pv = tl.dot(pr.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr, v, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # Partials, unnormalised: PART [S, Hq, NUM_SPLITS, HEAD_DIM], ML [S, Hq, NUM_SPLITS, 2].
    hq = tl.num_programs(1) * GROUP
    base = (seq * hq + head) * NUM_SPLITS + split
    tl.store(PART + base[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    tl.store(ML + base * 2, m_i, mask=row_ok)
    tl.store(ML + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_reduce(PART, ML, OUT, QSTART, stride_ot, stride_oh, head_dim,
                   NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    base = (seq * hq + h) * NUM_SPLITS + sp
    m = tl.load(ML + base * 2)
    lsum = tl.load(ML + base * 2 + 1)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty splits weigh nothing
    acc = tl.load(PART + base[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    q_row = tl.load(QSTART + seq)
    tl.store(OUT + q_row * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty),
             mask=d < head_dim)


def decode_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                  sm_count: int = 132, block_n: int = 64) -> int:
    """How many context splits a decode launch uses: enough programs to fill the GPU twice
    over, no more than the longest table has key tiles, a power of two up to 16. A function
    of shapes only, so it is fixed for each CUDA graph bucket."""
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, -(-2 * sm_count // programs))
    tiles = max(1, -(-max_blocks * block_size // block_n))
    return min(16, triton.next_power_of_2(min(want, tiles)))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, q_start: torch.Tensor, ctx_start: torch.Tensor,
    scale: float, num_splits: int, out: torch.Tensor | None = None, block_n: int = 64,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Decode attention (one query per sequence, at position ctx_start[i]) with the context
    split `num_splits` ways (a power of two), partials combined by a second small kernel.
    Same arguments and result as `paged_attention` with max_q_len 1."""
    T, hq, hd = q.shape
    _, bs, hkv, _ = k_cache.shape
    if hq % hkv or num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError("q heads must be a multiple of kv heads; num_splits a power of two")
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    S = block_tables.shape[0]
    if S == 0:
        return out
    hdp = max(16, triton.next_power_of_2(hd))
    part = torch.empty((S, hq, num_splits, hdp), dtype=torch.float32, device=q.device)
    ml = torch.empty((S, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    launch = {"num_warps": num_warps} if num_warps else {}
    _launcher(_paged_decode_split, q.device)[(S, hkv, num_splits)](
        q, k_cache, v_cache, part, ml, block_tables, q_start, ctx_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        hd, scale * math.log2(math.e),
        NUM_SPLITS=num_splits, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, HEAD_DIM=hdp, BLOCK_SIZE=bs,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.device.type == "cpu" and q.dtype != torch.float32, **launch)
    _launcher(_decode_reduce, q.device)[(S, hq)](
        part, ml, out, q_start, out.stride(0), out.stride(1), hd,
        NUM_SPLITS=num_splits, HEAD_DIM=hdp)
    return out


# -- RMSNorm with the residual add ------------------------------------------------------------
@triton.jit
def _rms_norm(X, R, W, Y, ROUT, n_cols, stride_x, stride_r, stride_y, stride_ro, eps,
              HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    # The residual stream is kept in the model's dtype, as the reference adds in it.
    xr = x.to(ROUT.dtype.element_ty)
    tl.store(ROUT + row * stride_ro + cols, xr, mask=m)
    xf = xr.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    yn = (xf * tl.rsqrt(var + eps)).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (yn * w).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without `residual`, of x alone.

    x, residual: [T, D]. The sum is returned as the new residual stream (in x's dtype)."""
    T, D = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is None else residual  # updated in place
    if T == 0:
        return y, res_out
    r = residual if residual is not None else x
    _launcher(_rms_norm, x.device)[(T,)](
        x, r, weight, y, res_out, D, x.stride(0), r.stride(0), y.stride(0), res_out.stride(0),
        eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(D))
    return y, res_out


# -- RoPE, and the KV write into the pool -------------------------------------------------------
@triton.jit
def _rope_and_cache(QKV, QOUT, K, V, COS, SIN, POS, SLOT,
                    stride_t, stride_qo_t, stride_qo_h,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_cos,
                    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(COS + pos * stride_cos + i)
    sin = tl.load(SIN + pos * stride_cos + i)
    base = QKV + t * stride_t + h * HEAD_DIM  # q heads, then k heads, then v heads
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    r1 = x1 * cos - x2 * sin  # rotate-half RoPE (used for q and k heads)
    r2 = x2 * cos + x1 * sin
    # Masked stores rather than branches: one program per (token, head) of q, k or v.
    hv = tl.zeros([HALF], tl.int32) + h  # masks are blocks, not scalars
    is_q = hv < HQ
    is_k = (hv >= HQ) & (hv < HQ + HKV)
    is_v = hv >= HQ + HKV
    qo = QOUT + t * stride_qo_t + tl.minimum(h, HQ - 1) * stride_qo_h
    tl.store(qo + i, r1.to(QOUT.dtype.element_ty), mask=is_q)
    tl.store(qo + HALF + i, r2.to(QOUT.dtype.element_ty), mask=is_q)
    slot = tl.load(SLOT + t).to(tl.int64)
    ok = (tl.zeros([HALF], tl.int64) + slot) >= 0  # slot < 0: a padded row, writes nothing
    blk = tl.maximum(slot, 0) // BLOCK_SIZE
    off = tl.maximum(slot, 0) % BLOCK_SIZE
    kh = tl.minimum(tl.maximum(h - HQ, 0), HKV - 1)
    kp = K + blk * stride_kb + off * stride_kt + kh * stride_kh
    tl.store(kp + i, r1.to(K.dtype.element_ty), mask=ok & is_k)
    tl.store(kp + HALF + i, r2.to(K.dtype.element_ty), mask=ok & is_k)
    vh = tl.minimum(tl.maximum(h - HQ - HKV, 0), HKV - 1)
    vp = V + blk * stride_vb + off * stride_vt + vh * stride_vh
    tl.store(vp + i, x1.to(V.dtype.element_ty), mask=ok & is_v)  # v: copied as it is
    tl.store(vp + HALF + i, x2.to(V.dtype.element_ty), mask=ok & is_v)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of `qkv` [T, (Hq + 2 Hkv) * D]; write k and v to the pool slots.

    cos, sin: [max_position, D/2] fp32; positions, slots: [T] int32, slot = block *
    block_size + offset, or -1 for a row that must write nothing. k_cache/v_cache: one
    layer's views of the pool as for `paged_attention`. Returns q, [T, Hq, D]."""
    T = qkv.shape[0]
    _, bs, _, hd = k_cache.shape
    if qkv.stride(1) != 1 or hd & (hd - 1):
        raise ValueError("qkv rows must be contiguous and head_dim a power of two")
    q = torch.empty((T, num_heads, hd), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    _launcher(_rope_and_cache, qkv.device)[(T, num_heads + 2 * num_kv_heads)](
        qkv, q, k_cache, v_cache, cos, sin, positions, slots,
        qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
        HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=hd, HALF=hd // 2, BLOCK_SIZE=bs)
    return q


# -- SwiGLU ---------------------------------------------------------------------------------
@triton.jit
def _silu_mul(GU, OUT, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    gate = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n + cols, mask=m, other=0.0)
    # Rounded to the model's dtype before the product, as F.silu(gate) * up is.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(OUT + row * stride_o + cols, act * up, mask=m)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up], [T, 2F] -> [T, F]."""
    T, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty((T, f), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    b = min(block, triton.next_power_of_2(f))
    _launcher(_silu_mul, gate_up.device)[(T, triton.cdiv(f, b))](
        gate_up, out, f, gate_up.stride(0), out.stride(0), BLOCK=b)
    return out
