// qgemm: y[M, N] = x[M, K] @ W^T with W kept as GGUF blocks of 32 along K (Q4_1, Q4_0:
// 4-bit codes; Q8_0: 8-bit) and x quantized per row and block of 32 to int16
// (d_a = max|x| / 32767). Per block:
//   sum_i w_i x_i = d_w d_a sum_i u_i p_i + m_w (d_a sum_i p_i)
// with u the weight code (Q4_1: q in 0..15, m_w = m; Q4_0: q, m_w = -8 d; Q8_0: the signed
// q, m_w = 0). The integer dot products are exact (int16 x int16 pairs summed in int32:
// vpmaddwd / vpdpwssd), so only the fp32 scaling per block rounds, in one fixed order.
//
// Why int16 activations and not int8 as llama.cpp's Q8_1: the bundled 135M model's greedy
// answers follow float32's on the shipped agreement questions with int16 activations (49 of
// 50) and flip at near-ties with int8 ones (24 of 50; docs/results/executor/README.md).
// On AVX2 both take two multiply instructions per 32 multiply-adds (vpmaddwd twice, or
// vpmaddubsw then vpmaddwd against ones); on AVX-512 VNNI int16 does half as many per
// instruction (vpdpwssd against vpdpbusd).
//
// One kernel, written once over a small set of ISA primitives (`Isa` below): AVX-512 (BW,
// with VNNI when present) holds a 16-column tile in one register, AVX2 in two; the scalar
// reference computes the same integers and the same fp32 operations in the same order, so
// every path gives bit-identical results (tests compare them). Every row is computed in the
// same order whatever M is: a row's result does not depend on the batch around it.
//
// Packed weights, per tile of 16 output columns and block g (worker/quant.py pack_qgemm),
// vectors of 16 columns x 4 bytes (one 32-bit lane per column, little-endian):
//   4-bit: 4 vectors (256 bytes); vector z holds k = 8z..8z+7 of each column as two 16-bit
//          words of four nibbles, nibble p of the low word = k 8z + 2p, of the high word =
//          k 8z + 2p + 1: nibble p of both words is the int16 pair (k, k + 1) that one
//          vpmaddwd multiplies with the activations' pair at k = 8z + 2p.
//   8-bit: 8 vectors (512 bytes); vector z holds k = 4z..4z+3 as bytes (4z, 4z+2, 4z+1, 4z+3):
//          the low bytes of the two words are the pair (4z, 4z+1), the high bytes (4z+2, 4z+3).
//   scales: fp16 [tiles][G][2][16]: d then m of the 16 columns (the GGUF fp16 values).
#include "common.h"
#include "ops.h"

#include <vector>

namespace si {

constexpr int QMAX = 32767;  // int16 activations

struct QAct {
  std::vector<int16_t> q;  // [M][G][32]
  std::vector<float> d, s;  // [M][G]: scale, scale * sum(q)
  const int32_t* words() const { return reinterpret_cast<const int32_t*>(q.data()); }
};

// One block of 32 values: q = nearbyint(v * (QMAX / amax)), d = amax / QMAX. The SIMD and
// scalar versions round identically (IEEE multiply, round-to-nearest-even conversion).
static inline void quantize_block(const float* v, int16_t* o, float& d, float& s) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float id = amax > 0 ? static_cast<float>(QMAX) / amax : 0.0f;
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; i += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(id)));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(x[i + 1], _mm256_set1_ps(id)));
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
    // packs interleaves 128-bit halves: a0-3 b0-3 a4-7 b4-7 -> reorder 64-bit quarters
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8 * i), p);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  const int total = _mm_cvtsi128_si32(t);
#else
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float id = amax > 0 ? static_cast<float>(QMAX) / amax : 0.0f;
  int total = 0;
  for (int i = 0; i < 32; ++i) {
    const int qi = static_cast<int>(std::nearbyint(v[i] * id));
    o[i] = static_cast<int16_t>(qi);
    total += qi;
  }
#endif
  d = amax / static_cast<float>(QMAX);
  s = d * static_cast<float>(total);
}

static void quantize_rows(const float* x, int64_t M, int64_t K, QAct& a) {
  const int64_t G = K / 32;
  a.q.resize(M * K);
  a.d.resize(M * G);
  a.s.resize(M * G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g)
      quantize_block(x + r * K + g * 32, a.q.data() + (r * G + g) * 32, a.d[r * G + g],
                     a.s[r * G + g]);
}

// ---------------------------------------------------------------- ISA primitives
// H registers per 16-column tile; load(p, h): 16 / H columns x 4 bytes of a 64-byte vector.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SI_QGEMM_SIMD 1
struct Isa {
  static constexpr int H = 1;
  using VI = __m512i;
  using VF = __m512;
  static const char* name() {
#if defined(__AVX512VNNI__)
    return "avx512-vnni";
#else
    return "avx512";
#endif
  }
  static VI load(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
  static VI zero_i() { return _mm512_setzero_si512(); }
  template <int P> static VI nibble(VI w) {  // nibble P of every 16-bit word
    if constexpr (P == 0) return _mm512_and_si512(w, _mm512_set1_epi16(0x000F));
    else if constexpr (P == 3) return _mm512_srli_epi16(w, 12);
    else return _mm512_and_si512(_mm512_srli_epi16(w, 4 * P), _mm512_set1_epi16(0x000F));
  }
  static VI low_byte(VI w) { return _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8); }
  static VI high_byte(VI w) { return _mm512_srai_epi16(w, 8); }
  static VI dot(VI acc, VI w, int32_t pair) {  // acc + sum of the two int16 products per lane
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(pair));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(pair)));
#endif
  }
  static VF zero_f() { return _mm512_setzero_ps(); }
  static VF scales(const at::Half* p, int) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static VF cvt(VI v) { return _mm512_cvtepi32_ps(v); }
  static VF mul(VF a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
  static VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static VF fmadd(VF a, float b, VF c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
  static void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SI_QGEMM_SIMD 1
struct Isa {
  static constexpr int H = 2;
  using VI = __m256i;
  using VF = __m256;
  static const char* name() {
#if defined(__AVXVNNI__)
    return "avx2-vnni";
#else
    return "avx2";
#endif
  }
  static VI load(const uint8_t* p, int h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
  }
  static VI zero_i() { return _mm256_setzero_si256(); }
  template <int P> static VI nibble(VI w) {
    if constexpr (P == 0) return _mm256_and_si256(w, _mm256_set1_epi16(0x000F));
    else if constexpr (P == 3) return _mm256_srli_epi16(w, 12);
    else return _mm256_and_si256(_mm256_srli_epi16(w, 4 * P), _mm256_set1_epi16(0x000F));
  }
  static VI low_byte(VI w) { return _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8); }
  static VI high_byte(VI w) { return _mm256_srai_epi16(w, 8); }
  static VI dot(VI acc, VI w, int32_t pair) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, _mm256_set1_epi32(pair));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(pair)));
#endif
  }
  static VF zero_f() { return _mm256_setzero_ps(); }
  static VF scales(const at::Half* p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)));
  }
  static VF cvt(VI v) { return _mm256_cvtepi32_ps(v); }
  static VF mul(VF a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
  static VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  static VF fmadd(VF a, float b, VF c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
  static void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
};
#else
#define SI_QGEMM_SIMD 0
#endif

#if SI_QGEMM_SIMD
// R rows x C tiles (16 columns each), all G blocks.
template <int BITS, int R, int C>
inline void qgemm_tile(const QAct& a, int64_t r0, const uint8_t* w, const at::Half* sc,
                       int64_t G, int64_t t0, float* out, int64_t ldo) {
  using VI = Isa::VI;
  using VF = Isa::VF;
  constexpr int H = Isa::H, NZ = BITS == 4 ? 4 : 8;  // 64-byte vectors per tile and block
  constexpr int64_t WB = 64 * NZ;
  VF acc[R][C][H];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < H; ++h) acc[r][c][h] = Isa::zero_f();
  const int32_t* words = a.words();  // [M][G][16]: the int16 pairs
  for (int64_t g = 0; g < G; ++g) {
    const int32_t* aw[R];
    for (int r = 0; r < R; ++r) aw[r] = words + ((r0 + r) * G + g) * 16;
    VI ai[R][C][H];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < H; ++h) ai[r][c][h] = Isa::zero_i();
    for (int c = 0; c < C; ++c) {
      const uint8_t* wp = w + ((t0 + c) * G + g) * WB;
      for (int z = 0; z < NZ; ++z)
        for (int h = 0; h < H; ++h) {
          const VI v = Isa::load(wp + 64 * z, h);
          if constexpr (BITS == 4) {
            const VI u0 = Isa::nibble<0>(v), u1 = Isa::nibble<1>(v);
            const VI u2 = Isa::nibble<2>(v), u3 = Isa::nibble<3>(v);
            for (int r = 0; r < R; ++r) {
              VI s = Isa::dot(ai[r][c][h], u0, aw[r][4 * z]);
              s = Isa::dot(s, u1, aw[r][4 * z + 1]);
              s = Isa::dot(s, u2, aw[r][4 * z + 2]);
              ai[r][c][h] = Isa::dot(s, u3, aw[r][4 * z + 3]);
            }
          } else {
            const VI lo = Isa::low_byte(v), hi = Isa::high_byte(v);
            for (int r = 0; r < R; ++r) {
              const VI s = Isa::dot(ai[r][c][h], lo, aw[r][2 * z]);
              ai[r][c][h] = Isa::dot(s, hi, aw[r][2 * z + 1]);
            }
          }
        }
    }
    for (int c = 0; c < C; ++c) {
      const at::Half* sp = sc + ((t0 + c) * G + g) * 32;
      for (int h = 0; h < H; ++h) {
        const VF dw = Isa::scales(sp, h), mw = Isa::scales(sp + 16, h);
        for (int r = 0; r < R; ++r) {
          const int64_t ag = (r0 + r) * G + g;
          acc[r][c][h] = Isa::fmadd(Isa::cvt(ai[r][c][h]), Isa::mul(dw, a.d[ag]), acc[r][c][h]);
          acc[r][c][h] = Isa::fmadd(mw, a.s[ag], acc[r][c][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < H; ++h)
        Isa::store(out + (r0 + r) * ldo + (t0 + c) * 16 + h * (16 / H), acc[r][c][h]);
}

template <int BITS, int R, int C>
void qgemm_rows(const QAct& a, int64_t r0, const uint8_t* w, const at::Half* sc, int64_t G,
                int64_t tb, int64_t te, float* out, int64_t ldo) {
  int64_t t = tb;
  for (; t + C <= te; t += C) qgemm_tile<BITS, R, C>(a, r0, w, sc, G, t, out, ldo);
  for (; t < te; ++t) qgemm_tile<BITS, R, 1>(a, r0, w, sc, G, t, out, ldo);
}

// Rows in register blocks: AVX-512 has 32 registers (R x C x 2 of them live), AVX2 16
// (R x C x 4). On AVX2 (a 2-core Zen 3 EPYC, one thread, CPU time) 3 rows x 1 tile was the
// fastest shape tried: 4 rows gained nothing, 2 rows x 2 tiles ran ~1.5x slower, and one
// row runs best with one tile.
template <int BITS>
void qgemm_impl(const QAct& a, int64_t M, const uint8_t* w, const at::Half* sc, int64_t G,
                int64_t tiles, float* out, int64_t ldo) {
  const int64_t macs_per_tile = std::max<int64_t>(1, M * G * 32 * 16);
  at::parallel_for(0, tiles, grain_for(macs_per_tile, grains().qgemm), [&](int64_t tb, int64_t te) {
    // tiles in steps of 4 so that a row block reuses a few tiles' weights from L1/L2
    for (int64_t t0 = tb; t0 < te; t0 += 4) {
      const int64_t t1 = std::min(te, t0 + 4);
      int64_t r = 0;
#if defined(__AVX512F__)
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
#else
      for (; r + 3 <= M; r += 3) qgemm_rows<BITS, 3, 1>(a, r, w, sc, G, t0, t1, out, ldo);
      switch (M - r) {
        case 2: qgemm_rows<BITS, 2, 1>(a, r, w, sc, G, t0, t1, out, ldo); break;
        case 1: qgemm_rows<BITS, 1, 1>(a, r, w, sc, G, t0, t1, out, ldo); break;
        default: break;
      }
#endif
    }
  });
}
#endif  // SI_QGEMM_SIMD

// Scalar reference of the same arithmetic (any CPU; slow, for checks and as a fallback):
// the same exact integer dot per block, then the same two fused multiply-adds.
static void qgemm_ref(const QAct& a, int64_t M, const uint8_t* w, const at::Half* sc, int64_t G,
                      int64_t tiles, int64_t bits, float* out, int64_t ldo) {
  const int64_t WB = bits == 4 ? 256 : 512;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t t = 0; t < tiles; ++t)
      for (int j = 0; j < 16; ++j) {
        float acc = 0;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* wp = w + (t * G + g) * WB;
          const int16_t* p = a.q.data() + (r * G + g) * 32;
          int32_t dotv = 0;
          for (int k = 0; k < 32; ++k) {
            int u;
            if (bits == 4) {  // k = 8z + 2p + word; nibble p of word `word` of lane j
              const int z = k / 8, p2 = (k % 8) / 2, word = k % 2;
              const uint16_t wd = static_cast<uint16_t>(wp[64 * z + 4 * j + 2 * word] |
                                                        (wp[64 * z + 4 * j + 2 * word + 1] << 8));
              u = (wd >> (4 * p2)) & 15;
            } else {  // k = 4z + i, byte order (4z, 4z+2, 4z+1, 4z+3)
              static constexpr int kByte[4] = {0, 2, 1, 3};
              u = static_cast<int8_t>(wp[64 * (k / 4) + 4 * j + kByte[k % 4]]);
            }
            dotv += u * p[k];
          }
          const float dw = static_cast<float>(sc[(t * G + g) * 32 + j]);
          const float mw = static_cast<float>(sc[(t * G + g) * 32 + 16 + j]);
          const float dwda = dw * a.d[r * G + g];
          acc = std::fma(static_cast<float>(dotv), dwda, acc);
          acc = std::fma(mw, a.s[r * G + g], acc);
        }
        out[r * ldo + t * 16 + j] = acc;
      }
}

std::string qgemm_isa() {
#if SI_QGEMM_SIMD
  return Isa::name();
#else
  return "scalar";
#endif
}

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
#if SI_QGEMM_SIMD
  if (!reference) {
    if (bits == 4) qgemm_impl<4>(a, M, wp, sp, G, tiles, out.data_ptr<float>(), n);
    else qgemm_impl<8>(a, M, wp, sp, G, tiles, out.data_ptr<float>(), n);
    return out;
  }
#endif
  qgemm_ref(a, M, wp, sp, G, tiles, bits, out.data_ptr<float>(), n);
  return out;
}

}  // namespace si
