// The small fused ops of a layer: RMSNorm with the residual add, RoPE with the K/V write
// into the pool, SiLU(gate) * up.
#include "common.h"
#include "ops.h"

#include <type_traits>

namespace si {

Grains& grains() {
  static Grains g;
  return g;
}

// ------------------------------------------------------------------------ RMSNorm

template <typename TD, typename TO>
static void rms_impl(float* x, const TD* delta, const float* w, TO* out, int64_t T, int64_t D,
                     float eps) {
  at::parallel_for(0, T, grain_for(D * 4, grains().elementwise), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = x + t * D;
      if (delta) {
        const TD* dr = delta + t * D;
        for (int64_t i = 0; i < D; ++i) xr[i] += f32(dr[i]);
      }
      float acc[LANES] = {0};
      int64_t i = 0;
      for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += xr[i + l] * xr[i + l];
      float ss = 0;
      for (int l = 0; l < LANES; ++l) ss += acc[l];
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      TO* o = out + t * D;
      for (int64_t j = 0; j < D; ++j) o[j] = cvt<TO>((xr[j] * inv) * w[j]);
    }
  });
}

at::Tensor add_rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "add_rms_norm: x must be a contiguous fp32 [T, D]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: w must be a contiguous fp32 [D]");
  const int64_t T = x.size(0), D = x.size(1);
  auto out = at::empty({T, D}, x.options().dtype(out_dtype));
  at::Tensor dl;
  if (delta.has_value()) {
    dl = delta->contiguous();
    TORCH_CHECK(dl.sizes() == x.sizes(), "add_rms_norm: delta and x differ in shape");
  }
  auto run = [&](auto* dptr) {
    using TD = std::remove_cv_t<std::remove_pointer_t<decltype(dptr)>>;
    if (out_dtype == at::kFloat)
      rms_impl<TD, float>(x.data_ptr<float>(), dptr, w.data_ptr<float>(), out.data_ptr<float>(),
                          T, D, static_cast<float>(eps));
    else if (out_dtype == at::kBFloat16)
      rms_impl<TD, BFloat16>(x.data_ptr<float>(), dptr, w.data_ptr<float>(),
                             out.data_ptr<BFloat16>(), T, D, static_cast<float>(eps));
    else
      TORCH_CHECK(false, "add_rms_norm: out dtype must be float32 or bfloat16");
  };
  if (!dl.defined()) run(static_cast<const float*>(nullptr));
  else if (dl.scalar_type() == at::kFloat) run(dl.data_ptr<float>());
  else if (dl.scalar_type() == at::kBFloat16) run(dl.data_ptr<BFloat16>());
  else TORCH_CHECK(false, "add_rms_norm: delta must be float32 or bfloat16");
  return out;
}

// ------------------------------------------------------------------------ RoPE + KV write

template <typename TA, typename TK>
static void rope_kv_impl(TA* qkv, int64_t T, int64_t ldq, const float* cosb, const float* sinb,
                         const int64_t* pos, TK* kv, KVGeom g, int64_t layer, const int64_t* blk,
                         const int64_t* off, int64_t hq) {
  const int64_t hd = g.hd, half = hd / 2, hkv = g.hkv;
  at::parallel_for(0, T, grain_for((hq + 2 * hkv) * hd * 4, grains().elementwise),
                   [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cosb + pos[t] * half;
      const float* s = sinb + pos[t] * half;
      TA* row = qkv + t * ldq;
      for (int64_t h = 0; h < hq + hkv; ++h) {  // q heads, then k heads, rotated in place
        TA* x = row + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(x[i]), x2 = f32(x[i + half]);
          x[i] = cvt<TA>(x1 * c[i] - x2 * s[i]);
          x[i + half] = cvt<TA>(x2 * c[i] + x1 * s[i]);
        }
      }
      TK* kdst = kv + blk[t] * g.block_stride() + layer * g.layer_stride() + off[t] * g.tok_stride();
      TK* vdst = kdst + g.kv_stride();
      const TA* ksrc = row + hq * hd;
      const TA* vsrc = row + (hq + hkv) * hd;
      for (int64_t i = 0; i < hkv * hd; ++i) {
        kdst[i] = cvt<TK>(f32(ksrc[i]));
        vdst[i] = cvt<TK>(f32(vsrc[i]));
      }
    }
  });
}

void rope_kv_write(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& pos, at::Tensor kv, int64_t layer,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t hq) {
  auto g = geom(kv);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_kv_write: qkv must be [T, width] rows");
  TORCH_CHECK(qkv.size(1) == (hq + 2 * g.hkv) * g.hd, "rope_kv_write: qkv width does not match the heads");
  TORCH_CHECK(pos.scalar_type() == at::kLong && slot_blocks.scalar_type() == at::kLong &&
                  slot_offsets.scalar_type() == at::kLong,
              "rope_kv_write: positions and slots must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == g.hd / 2,
              "rope_kv_write: cos/sin must be contiguous fp32 [positions, head_dim / 2]");
  TORCH_CHECK(layer >= 0 && layer < g.layers, "rope_kv_write: layer out of range");
  const int64_t T = qkv.size(0);
  auto go = [&](auto* q, auto* k) {
    rope_kv_impl(q, T, qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                 pos.data_ptr<int64_t>(), k, g, layer, slot_blocks.data_ptr<int64_t>(),
                 slot_offsets.data_ptr<int64_t>(), hq);
  };
  const bool qf = qkv.scalar_type() == at::kFloat, kf = kv.scalar_type() == at::kFloat;
  TORCH_CHECK(qf || qkv.scalar_type() == at::kBFloat16, "rope_kv_write: qkv must be fp32 or bf16");
  TORCH_CHECK(kf || kv.scalar_type() == at::kBFloat16, "rope_kv_write: the pool must be fp32 or bf16");
  if (qf && kf) go(qkv.data_ptr<float>(), kv.data_ptr<float>());
  else if (qf) go(qkv.data_ptr<float>(), kv.data_ptr<BFloat16>());
  else if (kf) go(qkv.data_ptr<BFloat16>(), kv.data_ptr<float>());
  else go(qkv.data_ptr<BFloat16>(), kv.data_ptr<BFloat16>());
}

// ------------------------------------------------------------------------ SwiGLU

template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t R, int64_t F) {
  at::parallel_for(0, R, grain_for(F * 8, grains().elementwise), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * 2 * F;
      const T* u = g + F;
      T* o = out + r * F;
      int64_t i = 0;
#if SI_VF
      constexpr int W = Vf::W;
      alignas(64) float tmp[W];
      for (; i + W <= F; i += W) {
        const Vf::T x = Vf::load(g + i);
        const Vf::T den = Vf::add(Vf::set1(1.0f), vexp(Vf::sub(Vf::zero(), x)));
        Vf::store(tmp, Vf::mul(Vf::div(x, den), Vf::load(u + i)));
        for (int l = 0; l < W; ++l) o[i + l] = cvt<T>(tmp[l]);
      }
#endif
      for (; i < F; ++i) {
        const float x = f32(g[i]);
        o[i] = cvt<T>(x / (1.0f + std::exp(-x)) * f32(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  auto x = gu.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: expects [R, 2F]");
  const int64_t R = x.size(0), F = x.size(1) / 2;
  auto out = at::empty({R, F}, x.options());
  if (x.scalar_type() == at::kFloat) silu_mul_impl(x.data_ptr<float>(), out.data_ptr<float>(), R, F);
  else if (x.scalar_type() == at::kBFloat16)
    silu_mul_impl(x.data_ptr<BFloat16>(), out.data_ptr<BFloat16>(), R, F);
  else TORCH_CHECK(false, "silu_mul: float32 or bfloat16");
  return out;
}

}  // namespace si
