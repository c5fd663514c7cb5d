// Shared helpers of the CPU kernels: bf16 <-> fp32, AVX-512 loads and exp, fork grains,
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

#if defined(__AVX512F__)
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

#if defined(__AVX512F__)
inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// exp(x) with x clamped to [-87, 88]: 2^n * p(r), relative error < 2e-7
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
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
