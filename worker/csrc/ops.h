// The kernels other translation units call (and the Python module binds).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace si {

// x (fp32 [T, D]) += delta (optional, fp32 or bf16 [T, D]); returns rmsnorm(x) * w as out_dtype.
at::Tensor add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps, at::ScalarType out_dtype);

// Rotates q and k of qkv [T, (hq + 2 hkv) hd] in place (rotate-half RoPE at positions pos)
// and writes k, v into the pool at (slot_blocks[t], layer, {K, V}, slot_offsets[t]).
void rope_kv_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& pos, at::Tensor kv, int64_t layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t hq);

// For each row t in qidx: q[t] (hq heads) attends to positions [0, ctx[t]) of the sequence
// whose block table is tables[qrow[t]], reading K/V where they lie in the pool.
void paged_attention(const at::Tensor& q, at::Tensor out, const at::Tensor& kv, int64_t layer,
                     const at::Tensor& tables, const at::Tensor& qrow, const at::Tensor& ctx,
                     const at::Tensor& qidx, int64_t hq, double scale);

// gu [R, 2F] = (gate | up) -> silu(gate) * up [R, F]
at::Tensor silu_mul(const at::Tensor& gu);

// x [M, K] (fp32 or bf16) @ W^T -> fp32 [M, n] over GGUF-style packed blocks (see qgemm.cpp).
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t bits,
                 int64_t n, bool reference);
// the SIMD path qgemm was built with: avx512-vnni, avx512, avx2-vnni, avx2, or scalar
std::string qgemm_isa();

}  // namespace si
