// qgemm: y[M, N] = x[M, K] @ W^T with W kept as GGUF blocks of 32 along K (Q4_1, Q4_0:
// 4-bit codes; Q8_0: 8-bit) and x quantized per row and block of 32 to int8
// (d_a = max|x| / 127, like llama.cpp's Q8_1 activations). Per block:
//   sum_i w_i x_i = d_w d_a sum_i u_i p_i + m_w (d_a sum_i p_i)
// with u the unsigned weight code (Q4_1: q, m_w = m; Q4_0: q, m_w = -8 d; Q8_0: q + 128,
// m_w = -128 d), so one AVX512-VNNI vpdpbusd (u8 x s8, 64 MACs) does 4 k of 16 columns.
// Every row is computed in the same order whatever M is: a row's result does not depend
// on the batch around it.
//
// Packed weights, per tile of 16 output columns and block g (worker/quant.py pack_vnni):
//   4-bit: 256 bytes = 4 x [16 columns x 4 bytes]; byte i of column j in vector z holds
//          k = 4z + i (low nibble) and k = 16 + 4z + i (high nibble)
//   8-bit: 512 bytes = 8 x [16 columns x 4 bytes] = k 4s..4s+3 in vector s
//   scales: fp16 [tiles][G][2][16]: d then m of the 16 columns (the GGUF fp16 values).
#include "common.h"
#include "ops.h"

#include <vector>

namespace si {


struct QAct {
  std::vector<int8_t> q;  // [M][G][32]
  std::vector<float> d, s;  // [M][G]: scale, scale * sum(q)
};

static void quantize_rows(const float* x, int64_t M, int64_t K, QAct& a) {
  const int64_t G = K / 32;
  a.q.resize(M * K);
  a.d.resize(M * G);
  a.s.resize(M * G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + r * K + g * 32;
      int8_t* o = a.q.data() + (r * G + g) * 32;
#if defined(__AVX512F__)
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm512_cvtsepi32_epi8(i1));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int qi = static_cast<int>(std::nearbyint(v[i] * id));
        o[i] = static_cast<int8_t>(qi);
        sum += qi;
      }
#endif
      a.d[r * G + g] = d;
      a.s[r * G + g] = d * static_cast<float>(sum);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kHaveVnni = true;

// R rows x C tiles (16 columns each), all G blocks.
template <int BITS, int R, int C>
inline void qgemm_tile(const QAct& a, int64_t r0, const uint8_t* w, const at::Half* sc,
                       int64_t G, int64_t t0, float* out, int64_t ldo) {
  constexpr int64_t WB = BITS == 4 ? 256 : 512;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i lomask = _mm512_set1_epi8(0x0F);
  const int32_t* words = reinterpret_cast<const int32_t*>(a.q.data());
  for (int64_t g = 0; g < G; ++g) {
    __m512i ai[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) ai[r][c][0] = ai[r][c][1] = _mm512_setzero_si512();
    for (int c = 0; c < C; ++c) {
      const uint8_t* wp = w + ((t0 + c) * G + g) * WB;
      for (int z = 0; z < 4; ++z) {
        __m512i lo, hi;
        if constexpr (BITS == 4) {
          const __m512i v = _mm512_loadu_si512(wp + 64 * z);
          lo = _mm512_and_si512(v, lomask);
          hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lomask);
        } else {
          lo = _mm512_loadu_si512(wp + 64 * z);
          hi = _mm512_loadu_si512(wp + 64 * (z + 4));
        }
        for (int r = 0; r < R; ++r) {
          const int32_t* aw = words + ((r0 + r) * G + g) * 8;
          ai[r][c][0] = _mm512_dpbusd_epi32(ai[r][c][0], lo, _mm512_set1_epi32(aw[z]));
          ai[r][c][1] = _mm512_dpbusd_epi32(ai[r][c][1], hi, _mm512_set1_epi32(aw[z + 4]));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const at::Half* sp = sc + ((t0 + c) * G + g) * 32;
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 16)));
      for (int r = 0; r < R; ++r) {
        const int64_t ag = (r0 + r) * G + g;
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(ai[r][c][0], ai[r][c][1]));
        acc[r][c] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ag])), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ag]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r0 + r) * ldo + (t0 + c) * 16, acc[r][c]);
}

template <int BITS, int R, int C>
void qgemm_rows(const QAct& a, int64_t r0, const uint8_t* w, const at::Half* sc, int64_t G,
                int64_t tb, int64_t te, float* out, int64_t ldo) {
  int64_t t = tb;
  for (; t + C <= te; t += C) qgemm_tile<BITS, R, C>(a, r0, w, sc, G, t, out, ldo);
  for (; t < te; ++t) qgemm_tile<BITS, R, 1>(a, r0, w, sc, G, t, out, ldo);
}

template <int BITS>
void qgemm_impl(const QAct& a, int64_t M, const uint8_t* w, const at::Half* sc, int64_t G,
                int64_t tiles, float* out, int64_t ldo) {
  const int64_t macs_per_tile = std::max<int64_t>(1, M * G * 32 * 16);
  at::parallel_for(0, tiles, grain_for(macs_per_tile, grains().qgemm), [&](int64_t tb, int64_t te) {
    // tiles in steps of 4 so that a row block reuses a few tiles' weights from L1/L2
    for (int64_t t0 = tb; t0 < te; t0 += 4) {
      const int64_t t1 = std::min(te, t0 + 4);
      int64_t r = 0;
      for (; r + 8 <= M; r += 8) qgemm_rows<BITS, 8, 1>(a, r, w, sc, G, t0, t1, out, ldo);
      switch (M - r) {
        case 7: qgemm_rows<BITS, 4, 2>(a, r, w, sc, G, t0, t1, out, ldo); r += 4;
                qgemm_rows<BITS, 3, 2>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 6: qgemm_rows<BITS, 3, 2>(a, r, w, sc, G, t0, t1, out, ldo); r += 3;
                qgemm_rows<BITS, 3, 2>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 5: qgemm_rows<BITS, 3, 2>(a, r, w, sc, G, t0, t1, out, ldo); r += 3;
                qgemm_rows<BITS, 2, 4>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 4: qgemm_rows<BITS, 4, 2>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 3: qgemm_rows<BITS, 3, 2>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 2: qgemm_rows<BITS, 2, 4>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 1: qgemm_rows<BITS, 1, 4>(a, r, w, sc, G, t0, t1, out, ldo); break;
        default: break;
      }
    }
  });
}
#else
constexpr bool kHaveVnni = false;
#endif

// Scalar reference of the same arithmetic (any CPU; slow, for checks and as a fallback).
static void qgemm_ref(const QAct& a, int64_t M, const uint8_t* w, const at::Half* sc, int64_t G,
               int64_t tiles, int64_t bits, float* out, int64_t ldo) {
  const int64_t WB = bits == 4 ? 256 : 512;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t t = 0; t < tiles; ++t)
      for (int j = 0; j < 16; ++j) {
        float acc = 0;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* wp = w + (t * G + g) * WB;
          const int8_t* p = a.q.data() + (r * G + g) * 32;
          int32_t dotv = 0;
          for (int k = 0; k < 32; ++k) {
            int u;
            if (bits == 4) {
              const int s = k / 4, i = k % 4;  // k = 4s + i; s < 4 low nibble of vector s, else high of s-4
              const uint8_t b = wp[64 * (s % 4) + 4 * j + i];
              u = s < 4 ? (b & 15) : (b >> 4);
            } else {
              u = wp[64 * (k / 4) + 4 * j + (k % 4)];
            }
            dotv += u * p[k];
          }
          const float dw = static_cast<float>(sc[(t * G + g) * 32 + j]);
          const float mw = static_cast<float>(sc[(t * G + g) * 32 + 16 + j]);
          acc += static_cast<float>(dotv) * (dw * a.d[r * G + g]) + mw * a.s[r * G + g];
        }
        out[r * ldo + t * 16 + j] = acc;
      }
}

bool have_vnni() { return kHaveVnni; }

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t bits,
                 int64_t n, bool reference) {
  TORCH_CHECK(bits == 4 || bits == 8, "qgemm: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2, "qgemm: x must be [M, K]");
  auto xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), G = K / 32, tiles = n / 16;
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0, "qgemm: needs K % 32 == 0 and N % 16 == 0");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == tiles * G * (bits == 4 ? 256 : 512),
              "qgemm: packed weight size mismatch");
  TORCH_CHECK(sc.scalar_type() == at::kHalf && sc.is_contiguous() && sc.numel() == tiles * G * 32,
              "qgemm: scales size mismatch");
  auto out = at::empty({M, n}, xf.options());
  thread_local QAct a;
  quantize_rows(xf.data_ptr<float>(), M, K, a);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  if (reference || !kHaveVnni) {
    qgemm_ref(a, M, wp, sp, G, tiles, bits, out.data_ptr<float>(), n);
    return out;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (bits == 4) qgemm_impl<4>(a, M, wp, sp, G, tiles, out.data_ptr<float>(), n);
  else qgemm_impl<8>(a, M, wp, sp, G, tiles, out.data_ptr<float>(), n);
#endif
  return out;
}

}  // namespace si
