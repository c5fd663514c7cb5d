// Paged attention over the block-first pool, reading K/V where they lie (no gather into
// a padded copy). One description serves decode rows (ctx = position + 1) and prefill
// rows with a cached prefix (each row its own causal limit). A vector path (AVX-512 or AVX2,
// common.h Vf) specialised on head_dim (64, 128) and the query heads per KV head, a generic
// path otherwise.
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


#if SI_VF
// One (query row, kv head) item with head_dim HD (a multiple of the vector width) and GRP
// query heads per kv head.
template <int HD, int GRP, typename TA, typename TK>
void attn_item_vec(const TA* q, TA* out, const TK* kv, KVGeom g, int64_t layer,
                   const int32_t* tab, int64_t L, int64_t h, float scale, float* sc) {
  constexpr int W = Vf::W, NV = HD / W;
  using V = Vf::T;
  const int64_t bs = g.bs, ts = g.tok_stride();
  V qv[GRP][NV];
  for (int gq = 0; gq < GRP; ++gq)
    for (int v = 0; v < NV; ++v)
      qv[gq][v] = Vf::mul(Vf::load(q + (h * GRP + gq) * HD + W * v), Vf::set1(scale));
  // scores, stored [GRP][L]
  for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
    const TK* kb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + h * HD;
    const int64_t n = std::min(bs, L - j0);
    for (int64_t o = 0; o < n; ++o) {
      const TK* kp = kb + o * ts;
      V kk[NV];
      for (int v = 0; v < NV; ++v) kk[v] = Vf::load(kp + W * v);
      for (int gq = 0; gq < GRP; ++gq) {
        V a = Vf::mul(qv[gq][0], kk[0]);
        for (int v = 1; v < NV; ++v) a = Vf::fmadd(qv[gq][v], kk[v], a);
        sc[gq * L + j0 + o] = Vf::reduce_add(a);
      }
    }
  }
  // softmax numerators in place, per head
  float inv[GRP];
  for (int gq = 0; gq < GRP; ++gq) {
    float* s = sc + gq * L;
    V mv = Vf::set1(-INFINITY);
    int64_t j = 0;
    for (; j + W <= L; j += W) mv = Vf::max(mv, Vf::load(s + j));
    float m = Vf::reduce_max(mv);
    for (; j < L; ++j) m = std::max(m, s[j]);
    const V mm = Vf::set1(m);
    V sv = Vf::zero();
    j = 0;
    for (; j + W <= L; j += W) {
      const V e = vexp(Vf::sub(Vf::load(s + j), mm));
      Vf::store(s + j, e);
      sv = Vf::add(sv, e);
    }
    if (j < L) {
      const int rest = static_cast<int>(L - j);
      const V e = Vf::keep_first(vexp(Vf::sub(Vf::load_first(s + j, rest), mm)), rest);
      Vf::store_first(s + j, e, rest);
      sv = Vf::add(sv, e);
    }
    inv[gq] = 1.0f / Vf::reduce_add(sv);
  }
  V acc[GRP][NV];
  for (int gq = 0; gq < GRP; ++gq)
    for (int v = 0; v < NV; ++v) acc[gq][v] = Vf::zero();
  for (int64_t j0 = 0, bi = 0; j0 < L; j0 += bs, ++bi) {
    const TK* vb = kv + tab[bi] * g.block_stride() + layer * g.layer_stride() + g.kv_stride() + h * HD;
    const int64_t n = std::min(bs, L - j0);
    for (int64_t o = 0; o < n; ++o) {
      const TK* vp = vb + o * ts;
      V vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = Vf::load(vp + W * v);
      for (int gq = 0; gq < GRP; ++gq) {
        const V p = Vf::set1(sc[gq * L + j0 + o]);
        for (int v = 0; v < NV; ++v) acc[gq][v] = Vf::fmadd(p, vv[v], acc[gq][v]);
      }
    }
  }
  for (int gq = 0; gq < GRP; ++gq) {
    const V iv = Vf::set1(inv[gq]);
    alignas(64) float tmp[W];
    for (int v = 0; v < NV; ++v) {
      Vf::store(tmp, Vf::mul(acc[gq][v], iv));
      TA* o = out + (h * GRP + gq) * HD + W * v;
      for (int l = 0; l < W; ++l) o[l] = cvt<TA>(tmp[l]);
    }
  }
}

template <int HD, int GRP, typename TA, typename TK>
void paged_attn_vec(const TA* q, int64_t ldq, TA* out, int64_t ldo, const TK* kv, KVGeom g,
                    int64_t layer, const int32_t* tables, int64_t tstride, const int32_t* qrow,
                    const int32_t* ctx, const int32_t* qidx, int64_t nq, float scale,
                    int64_t grain_work) {
  int64_t maxL = 1, sumL = 0;
  for (int64_t i = 0; i < nq; ++i) {
    maxL = std::max<int64_t>(maxL, ctx[qidx[i]]);
    sumL += ctx[qidx[i]];
  }
  const int64_t hkv = g.hkv, items = nq * hkv;
  const int64_t per_item = std::max<int64_t>(1, sumL / nq) * GRP * HD * 2;
  at::parallel_for(0, items, grain_for(per_item, grain_work), [&](int64_t b, int64_t e) {
    std::vector<float> sc(GRP * maxL + Vf::W);
    for (int64_t it = b; it < e; ++it) {
      const int64_t t = qidx[it / hkv], h = it % hkv;
      attn_item_vec<HD, GRP>(q + t * ldq, out + t * ldo, kv, g, layer,
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
#define SI_ATTN(HD, GRP)                                                                    \
  if (g.hd == HD && grp == GRP) {                                                           \
    paged_attn_vec<HD, GRP>(q, ldq, out, ldo, kv, g, layer, tables, tstride, qrow, ctx,     \
                            qidx, nq, scale, grain_work);                                   \
    return true;                                                                            \
  }
  SI_ATTN(64, 1) SI_ATTN(64, 2) SI_ATTN(64, 3) SI_ATTN(64, 4) SI_ATTN(64, 8)
  SI_ATTN(128, 1) SI_ATTN(128, 2) SI_ATTN(128, 4) SI_ATTN(128, 8)
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
