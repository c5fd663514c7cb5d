// Paged attention over the block-first pool, reading K/V where they lie (no gather into
// a padded copy). One description serves decode rows (ctx = position + 1) and prefill
// rows with a cached prefix (each row its own causal limit). An AVX-512 path specialised
// on head_dim (64, 128) and the query heads per KV head, a generic path otherwise.
#include "common.h"
#include "ops.h"

#include <vector>

namespace si {

// For each listed query row t: heads of q (rows of qkv, stride ldq) attend to positions
// [0, ctx[t]) of the sequence whose block table is tables[qrow[t]], reading the pool in place.
template <typename TA, typename TK>
void paged_attn_impl(const TA* q, int64_t ldq, TA* out, int64_t ldo, const TK* kv, KVGeom g,
                     int64_t layer, const int32_t* tables, int64_t tstride, const int32_t* qrow,
                     const int32_t* ctx, const int32_t* qidx, int64_t nq, int64_t hq,
                     float scale) {
  const int64_t hkv = g.hkv, hd = g.hd, grp = hq / hkv, bs = g.bs;
  int64_t maxL = 1, sumL = 0;
  for (int64_t i = 0; i < nq; ++i) {
    maxL = std::max<int64_t>(maxL, ctx[qidx[i]]);
    sumL += ctx[qidx[i]];
  }
  const int64_t items = nq * hkv;
  const int64_t per_item = std::max<int64_t>(1, sumL / std::max<int64_t>(1, nq)) * grp * hd * 2;
  at::parallel_for(0, items, grain_for(per_item, 1 << 14), [&](int64_t b, int64_t e) {
    std::vector<float> sc(grp * maxL), qf(grp * hd), acc(grp * hd);
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = qidx[it / hkv], h = it % hkv;
      const int64_t L = ctx[t];
      const int32_t* tab = tables + static_cast<int64_t>(qrow[t]) * tstride;
      for (int64_t gq = 0; gq < grp; ++gq)
        for (int64_t d = 0; d < hd; ++d) qf[gq * hd + d] = f32(q[t * ldq + (h * grp + gq) * hd + d]);
      // scores
      for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
        const TK* kb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + h * hd;
        const int64_t n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o) {
          const TK* kp = kb + o * g.tok_stride();
          for (int64_t gq = 0; gq < grp; ++gq) sc[gq * L + j0 + o] = dot(&qf[gq * hd], kp, hd) * scale;
        }
      }
      // softmax per query head
      for (int64_t gq = 0; gq < grp; ++gq) {
        float* s = &sc[gq * L];
        float m = -INFINITY;
        for (int64_t j = 0; j < L; ++j) m = std::max(m, s[j]);
        float sum = 0;
        for (int64_t j = 0; j < L; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < L; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
        const TK* vb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + g.kv_stride() + h * hd;
        const int64_t n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o) {
          const TK* vp = vb + o * g.tok_stride();
          for (int64_t gq = 0; gq < grp; ++gq) {
            const float p = sc[gq * L + j0 + o];
            float* a = &acc[gq * hd];
            for (int64_t d = 0; d < hd; ++d) a[d] += p * f32(vp[d]);
          }
        }
      }
      for (int64_t gq = 0; gq < grp; ++gq)
        for (int64_t d = 0; d < hd; ++d)
          out[t * ldo + (h * grp + gq) * hd + d] = cvt<TA>(acc[gq * hd + d]);
    }
  });
}


#if defined(__AVX512F__)
// One (query row, kv head) item with head_dim = 16 * NV and GRP query heads per kv head.
template <int NV, int GRP, typename TA, typename TK>
void attn_item_avx512(const TA* q, TA* out, const TK* kv, KVGeom g, int64_t layer,
                      const int32_t* tab, int64_t L, int64_t h, float scale, float* sc) {
  constexpr int HD = 16 * NV;
  const int64_t bs = g.bs, ts = g.tok_stride();
  __m512 qv[GRP][NV];
  for (int gq = 0; gq < GRP; ++gq)
    for (int v = 0; v < NV; ++v)
      qv[gq][v] = _mm512_mul_ps(ld16(q + (h * GRP + gq) * HD + 16 * v), _mm512_set1_ps(scale));
  // scores, stored [GRP][L]
  for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
    const TK* kb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + h * HD;
    const int64_t n = std::min(bs, L - j0);
    for (int64_t o = 0; o < n; ++o) {
      const TK* kp = kb + o * ts;
      __m512 kk[NV];
      for (int v = 0; v < NV; ++v) kk[v] = ld16(kp + 16 * v);
      for (int gq = 0; gq < GRP; ++gq) {
        __m512 a = _mm512_mul_ps(qv[gq][0], kk[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(qv[gq][v], kk[v], a);
        sc[gq * L + j0 + o] = _mm512_reduce_add_ps(a);
      }
    }
  }
  // softmax numerators in place, per head
  float inv[GRP];
  for (int gq = 0; gq < GRP; ++gq) {
    float* s = sc + gq * L;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(mv);
    for (; j < L; ++j) m = std::max(m, s[j]);
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    j = 0;
    for (; j + 16 <= L; j += 16) {
      __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mm));
      _mm512_storeu_ps(s + j, e);
      sv = _mm512_add_ps(sv, e);
    }
    if (j < L) {
      const __mmask16 k = static_cast<__mmask16>((1u << (L - j)) - 1);
      __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mm));
      e = _mm512_maskz_mov_ps(k, e);
      _mm512_mask_storeu_ps(s + j, k, e);
      sv = _mm512_add_ps(sv, e);
    }
    inv[gq] = 1.0f / _mm512_reduce_add_ps(sv);
  }
  __m512 acc[GRP][NV];
  for (int gq = 0; gq < GRP; ++gq)
    for (int v = 0; v < NV; ++v) acc[gq][v] = _mm512_setzero_ps();
  for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
    const TK* vb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + g.kv_stride() + h * HD;
    const int64_t n = std::min(bs, L - j0);
    for (int64_t o = 0; o < n; ++o) {
      const TK* vp = vb + o * ts;
      __m512 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = ld16(vp + 16 * v);
      for (int gq = 0; gq < GRP; ++gq) {
        const __m512 p = _mm512_set1_ps(sc[gq * L + j0 + o]);
        for (int v = 0; v < NV; ++v) acc[gq][v] = _mm512_fmadd_ps(p, vv[v], acc[gq][v]);
      }
    }
  }
  for (int gq = 0; gq < GRP; ++gq) {
    const __m512 iv = _mm512_set1_ps(inv[gq]);
    alignas(64) float tmp[16];
    for (int v = 0; v < NV; ++v) {
      _mm512_store_ps(tmp, _mm512_mul_ps(acc[gq][v], iv));
      TA* o = out + (h * GRP + gq) * HD + 16 * v;
      for (int l = 0; l < 16; ++l) o[l] = cvt<TA>(tmp[l]);
    }
  }
}

template <int NV, int GRP, typename TA, typename TK>
void paged_attn_avx512(const TA* q, int64_t ldq, TA* out, int64_t ldo, const TK* kv, KVGeom g,
                       int64_t layer, const int32_t* tables, int64_t tstride, const int32_t* qrow,
                       const int32_t* ctx, const int32_t* qidx, int64_t nq, float scale,
                       int64_t grain_work) {
  int64_t maxL = 1, sumL = 0;
  for (int64_t i = 0; i < nq; ++i) {
    maxL = std::max<int64_t>(maxL, ctx[qidx[i]]);
    sumL += ctx[qidx[i]];
  }
  const int64_t hkv = g.hkv, items = nq * hkv;
  const int64_t per_item = std::max<int64_t>(1, sumL / nq) * GRP * 16 * NV * 2;
  at::parallel_for(0, items, grain_for(per_item, grain_work), [&](int64_t b, int64_t e) {
    std::vector<float> sc(GRP * maxL + 16);
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = qidx[it / hkv], h = it % hkv;
      attn_item_avx512<NV, GRP>(q + t * ldq, out + t * ldo, kv, g, layer,
                                tables + static_cast<int64_t>(qrow[t]) * tstride, ctx[t], h, scale,
                                sc.data());
    }
  });
}

template <typename TA, typename TK>
bool paged_attn_fast(const TA* q, int64_t ldq, TA* out, int64_t ldo, const TK* kv, KVGeom g,
                     int64_t layer, const int32_t* tables, int64_t tstride, const int32_t* qrow,
                     const int32_t* ctx, const int32_t* qidx, int64_t nq, int64_t hq, float scale,
                     int64_t grain_work) {
  const int64_t grp = hq / g.hkv;
#define SI_ATTN(NV, GRP)                                                                    \
  if (g.hd == 16 * NV && grp == GRP) {                                                      \
    paged_attn_avx512<NV, GRP>(q, ldq, out, ldo, kv, g, layer, tables, tstride, qrow, ctx,  \
                               qidx, nq, scale, grain_work);                                \
    return true;                                                                            \
  }
  SI_ATTN(4, 1) SI_ATTN(4, 2) SI_ATTN(4, 3) SI_ATTN(4, 4) SI_ATTN(4, 8)
  SI_ATTN(8, 1) SI_ATTN(8, 2) SI_ATTN(8, 4) SI_ATTN(8, 8)
#undef SI_ATTN
  return false;
}
#else
template <typename TA, typename TK>
bool paged_attn_fast(const TA*, int64_t, TA*, int64_t, const TK*, KVGeom, int64_t, const int32_t*,
                     int64_t, const int32_t*, const int32_t*, const int32_t*, int64_t, int64_t,
                     float, int64_t) {
  return false;
}
#endif

void paged_attention(const at::Tensor& q, at::Tensor out, const at::Tensor& kv, int64_t layer,
                     const at::Tensor& tables, const at::Tensor& qrow, const at::Tensor& ctx,
                     const at::Tensor& qidx, int64_t hq, double scale) {
  auto g = geom(kv);
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1,
              "paged_attention: q and out must be [T, hq * head_dim] rows");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "paged_attention: q and out differ in dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2,
              "paged_attention: tables must be a contiguous int32 [R, max_blocks]");
  TORCH_CHECK(qrow.scalar_type() == at::kInt && ctx.scalar_type() == at::kInt &&
                  qidx.scalar_type() == at::kInt,
              "paged_attention: qrow, ctx and qidx must be int32");
  TORCH_CHECK(hq % g.hkv == 0, "paged_attention: query heads must group over the KV heads");
  TORCH_CHECK(layer >= 0 && layer < g.layers, "paged_attention: layer out of range");
  const int64_t nq = qidx.numel();
  if (nq == 0) return;
  const int64_t work = grains().attention;
  auto go = [&](auto* qp, auto* op, auto* kp) {
    if (paged_attn_fast(qp, q.stride(0), op, out.stride(0), kp, g, layer,
                        tables.data_ptr<int32_t>(), tables.size(1), qrow.data_ptr<int32_t>(),
                        ctx.data_ptr<int32_t>(), qidx.data_ptr<int32_t>(), nq, hq,
                        static_cast<float>(scale), work))
      return;
    paged_attn_impl(qp, q.stride(0), op, out.stride(0), kp, g, layer, tables.data_ptr<int32_t>(),
                    tables.size(1), qrow.data_ptr<int32_t>(), ctx.data_ptr<int32_t>(),
                    qidx.data_ptr<int32_t>(), nq, hq, static_cast<float>(scale));
  };
  const bool af = q.scalar_type() == at::kFloat, kf = kv.scalar_type() == at::kFloat;
  TORCH_CHECK(af || q.scalar_type() == at::kBFloat16, "paged_attention: q must be fp32 or bf16");
  TORCH_CHECK(kf || kv.scalar_type() == at::kBFloat16, "paged_attention: the pool must be fp32 or bf16");
  if (af && kf) go(q.data_ptr<float>(), out.data_ptr<float>(), kv.data_ptr<float>());
  else if (af) go(q.data_ptr<float>(), out.data_ptr<float>(), kv.data_ptr<BFloat16>());
  else if (kf) go(q.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), kv.data_ptr<float>());
  else go(q.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), kv.data_ptr<BFloat16>());
}

}  // namespace si
