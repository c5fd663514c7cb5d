// Shared helpers of the CPU kernels: bf16 <-> fp32, float vectors (AVX-512 or AVX2) and exp,
// fork grains,
// and the geometry of the block-first KV pool
//   kv[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim].
//
// Plain loops over 16-float lanes where no intrinsic is needed: gcc -O3 -march=native
// vectorizes them (AVX-512 here, AVX2 elsewhere) without -ffast-math.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace si {

using at::BFloat16;

inline float f32(float v) { return v; }
inline float f32(BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T cvt(float v);
template <> inline float cvt<float>(float v) { return v; }
template <> inline BFloat16 cvt<BFloat16>(float v) {
  // round to nearest even (inputs are finite); branch-free so that loops vectorize
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  BFloat16 r;
  r.x = static_cast<uint16_t>(u >> 16);
  return r;
}

// Vf: the float vector of the widest ISA built for (AVX-512: 16 lanes, AVX2 + FMA: 8), the
// primitives the attention and SwiGLU kernels are written once over. SI_VF is 0 without it
// (those kernels then take their scalar loops).
#if defined(__AVX512F__)
#define SI_VF 1
struct Vf {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const BFloat16* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // the first n < W lanes; the others read as 0 / are left alone
  static T load_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static void store_first(float* p, T v, int n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  static T keep_first(T v, int n) { return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(T v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(T v) { return _mm512_reduce_max_ps(v); }
  static T round(T v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static T pow2(T p, T n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
};
#elif defined(__AVX2__) && defined(__FMA__)
#define SI_VF 1
struct Vf {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const BFloat16* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static T load_first(const float* p, int n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_first(float* p, T v, int n) { _mm256_maskstore_ps(p, first(n), v); }
  static T keep_first(T v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(first(n))); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(T v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static T round(T v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T pow2(T p, T n) {  // n in [-126, 127] here: build 2^n's exponent bits
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};
#else
#define SI_VF 0
#endif

#if SI_VF
// exp(x) with x clamped to [-87, 88]: 2^n * p(r), relative error < 2e-7
inline Vf::T vexp(Vf::T x) {
  x = Vf::min(Vf::max(x, Vf::set1(-87.0f)), Vf::set1(88.0f));
  const Vf::T n = Vf::round(Vf::mul(x, Vf::set1(1.44269504088896341f)));
  Vf::T r = Vf::fnmadd(n, Vf::set1(0.693359375f), x);
  r = Vf::fnmadd(n, Vf::set1(-2.12194440e-4f), r);
  Vf::T p = Vf::set1(1.9875691500e-4f);
  p = Vf::fmadd(p, r, Vf::set1(1.3981999507e-3f));
  p = Vf::fmadd(p, r, Vf::set1(8.3334519073e-3f));
  p = Vf::fmadd(p, r, Vf::set1(4.1665795894e-2f));
  p = Vf::fmadd(p, r, Vf::set1(1.6666665459e-1f));
  p = Vf::fmadd(p, r, Vf::set1(5.0000001201e-1f));
  p = Vf::fmadd(p, Vf::mul(r, r), Vf::add(r, Vf::set1(1.0f)));
  return Vf::pow2(p, n);
}
#endif

constexpr int LANES = 16;

template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += f32(a[i + l]) * f32(b[i + l]);
  float s = 0;
  for (int l = 0; l < LANES; ++l) s += acc[l];
  for (; i < n; ++i) s += f32(a[i]) * f32(b[i]);
  return s;
}

// Work per thread before a kernel forks (elementwise work; attention FMAs; qgemm MACs).
// An OpenMP fork/join costs ~2-10 us on an idle machine and a whole time slice when a
// thread is descheduled by another process, so small ranges run inline.
struct Grains {
  int64_t elementwise = 1 << 18;
  int64_t attention = 1 << 20;
  int64_t qgemm = 1 << 19;
};
Grains& grains();

inline int64_t grain_for(int64_t work_per_item, int64_t min_work) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_item));
}

struct KVGeom {
  int64_t layers, bs, hkv, hd;
  int64_t block_stride() const { return layers * 2 * bs * hkv * hd; }
  int64_t layer_stride() const { return 2 * bs * hkv * hd; }
  int64_t kv_stride() const { return bs * hkv * hd; }
  int64_t tok_stride() const { return hkv * hd; }
};

inline KVGeom geom(const at::Tensor& kv) {
  TORCH_CHECK(kv.dim() == 6 && kv.size(2) == 2 && kv.is_contiguous(),
              "kv pool must be a contiguous [blocks, layers, 2, block_size, kv_heads, head_dim]");
  return {kv.size(1), kv.size(3), kv.size(4), kv.size(5)};
}

}  // namespace si
