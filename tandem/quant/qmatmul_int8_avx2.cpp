// y = x @ W.T on AVX2 with the activations quantized to int8 per group: the semantics and the tile layout
// of qmatmul_vnni.cpp (read its header), for CPUs without AVX-512 VNNI, as llama.cpp runs its int8 dot
// products there. vpdpbusd's four byte products per 32-bit lane become vpmaddubsw (pairs into 16 bits)
// and vpmaddwd against ones (pairs of pairs into 32 bits). The integer sums stay exact:
//   4- and 5-bit weights are below 32, so a pair is at most 2 * 31 * 127 and never saturates 16 bits;
//   8-bit weights (stored + 128) multiply as |v| times x with v's sign moved onto x, where |v| <= 128
//   and |x| <= 127 (activations are quantized to [-127, 127]): a pair is at most 2 * 128 * 127 = 32512.
// So the results equal the VNNI build's up to float summation order, and a row's result depends on
// that row alone.
#include <immintrin.h>

#include "int8_tiles.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using tandem_int8::Activations;
using tandem_int8::TILE;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Per group: max |x| (exact), q = nearest-even(x * (127 / max)) (vcvtps2dq in the default rounding mode,
// as torch.round), and the sums of q and of x (x in a fixed order: lanes, then a tree).
Activations quantize(const float* x, int64_t rows, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  Activations a = tandem_int8::empty_activations(rows, K, groups);
  int8_t* q = a.q.data_ptr<int8_t>();
  float* scale = a.scale.data_ptr<float>();
  int32_t* qsum = a.qsum.data_ptr<int32_t>();
  float* sum = a.sum.data_ptr<float>();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  alignas(32) int32_t lanes[8];
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + m * K + g * group;
      __m256 amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8) {
        const __m256 v = _mm256_loadu_ps(xs + i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        total = _mm256_add_ps(total, v);
      }
      const float top = hmax(amax);
      const float inv = top > 0.f ? 127.f / top : 0.f;
      int32_t counted = 0;
      for (int64_t i = 0; i < group; i += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + i), _mm256_set1_ps(inv)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
        for (int l = 0; l < 8; ++l) {
          q[m * K + g * group + i + l] = (int8_t)lanes[l];
          counted += lanes[l];
        }
      }
      scale[m * groups + g] = top / 127.f;
      qsum[m * groups + g] = counted;
      sum[m * groups + g] = hsum(total);
    }
  }
  return a;
}

inline void load_scales(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load_scales(const at::Half* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// 32 bits of a mask as 32 bytes, 16 where the bit is set: byte k takes bit k.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i shuffle = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                             0x0303030303030303);
  const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), shuffle);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
  return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

// Block j (16 rows x 4 inputs) of one tile's group as two halves of 8 rows: unsigned bytes for 4 and 5
// bits, signed ones (the stored byte - 128) for 8.
template <int BITS>
inline void block(const uint8_t* g, int j, int group, __m256i& lo, __m256i& hi) {
  if constexpr (BITS == 8) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j * 64)), flip);
    hi = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j * 64 + 32)), flip);
  } else {
    const uint8_t* chunk = g + (j / 2) * 64;
    const __m256i nib = _mm256_set1_epi8(15);
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
    if (j & 1) {
      lo = _mm256_srli_epi16(lo, 4);
      hi = _mm256_srli_epi16(hi, 4);
    }
    lo = _mm256_and_si256(lo, nib);
    hi = _mm256_and_si256(hi, nib);
    if constexpr (BITS == 5) {
      uint64_t bits;
      std::memcpy(&bits, g + group * 8 + j * 8, 8);
      lo = _mm256_or_si256(lo, fifth_bits((uint32_t)bits));
      hi = _mm256_or_si256(hi, fifth_bits((uint32_t)(bits >> 32)));
    }
  }
}

// Pairs of 16-bit sums into their 32-bit lane (each lane then holds its four byte products).
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

template <int BITS, typename Scale, int M>
void tiles_kernel(const Activations& a, int64_t m0, int64_t K, const uint8_t* packed, const Scale* scale,
                  const float* mins, int64_t group, int32_t zero, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t groups = K / group;
  const int64_t group_bytes = BITS == 8 ? group * TILE : (BITS == 4 ? group * 8 : group * 10);
  const int blocks = (int)(group / 4);
  // 8-bit weights are summed as stored - 128, so the zero they are offset by loses its 128 too.
  const int32_t offset = BITS == 8 ? zero - 128 : zero;
  const int8_t* xq = a.q.data_ptr<int8_t>();
  const float* xscale = a.scale.data_ptr<float>();
  const int32_t* xqsum = a.qsum.data_ptr<int32_t>();
  const float* xsum = a.sum.data_ptr<float>();
  for (int64_t t = t0; t < t1; ++t) {
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const uint8_t* tile = packed + t * groups * group_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* gp = tile + g * group_bytes;
      tandem_int8::prefetch_ahead(gp, group_bytes, scale, mins, t * groups + g);
      __m256i iacc[M][2];
      for (int m = 0; m < M; ++m) iacc[m][0] = iacc[m][1] = _mm256_setzero_si256();
      if constexpr (BITS == 8) {
        for (int j = 0; j < blocks; ++j) {
          __m256i lo, hi;
          block<BITS>(gp, j, (int)group, lo, hi);
          const __m256i abs_lo = _mm256_abs_epi8(lo), abs_hi = _mm256_abs_epi8(hi);
          for (int m = 0; m < M; ++m) {
            int32_t four;
            std::memcpy(&four, xq + (m0 + m) * K + g * group + 4 * j, 4);
            const __m256i x4 = _mm256_set1_epi32(four);
            iacc[m][0] = _mm256_add_epi32(iacc[m][0], widen(_mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(x4, lo))));
            iacc[m][1] = _mm256_add_epi32(iacc[m][1], widen(_mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(x4, hi))));
          }
        }
      } else {
        // A 16-bit pair of 4- or 5-bit products is at most 2 * 31 * 127 = 7874, so four blocks' pairs
        // add up in 16 bits (31496) before one widening to 32.
        for (int j0 = 0; j0 < blocks; j0 += 4) {
          __m256i pairs[M][2];
          for (int m = 0; m < M; ++m) pairs[m][0] = pairs[m][1] = _mm256_setzero_si256();
          for (int j = j0; j < std::min(blocks, j0 + 4); ++j) {
            __m256i lo, hi;
            block<BITS>(gp, j, (int)group, lo, hi);
            for (int m = 0; m < M; ++m) {
              int32_t four;
              std::memcpy(&four, xq + (m0 + m) * K + g * group + 4 * j, 4);
              const __m256i x4 = _mm256_set1_epi32(four);
              pairs[m][0] = _mm256_add_epi16(pairs[m][0], _mm256_maddubs_epi16(lo, x4));
              pairs[m][1] = _mm256_add_epi16(pairs[m][1], _mm256_maddubs_epi16(hi, x4));
            }
          }
          for (int m = 0; m < M; ++m) {
            iacc[m][0] = _mm256_add_epi32(iacc[m][0], widen(pairs[m][0]));
            iacc[m][1] = _mm256_add_epi32(iacc[m][1], widen(pairs[m][1]));
          }
        }
      }
      __m256 ws[2], wm[2];
      load_scales(scale + (t * groups + g) * TILE, ws[0], ws[1]);
      if (mins) {
        wm[0] = _mm256_loadu_ps(mins + (t * groups + g) * TILE);
        wm[1] = _mm256_loadu_ps(mins + (t * groups + g) * TILE + 8);
      }
      for (int m = 0; m < M; ++m) {
        const int64_t mg = (m0 + m) * groups + g;
        const __m256i shift = _mm256_set1_epi32(offset * xqsum[mg]);
        const __m256 xs = _mm256_set1_ps(xscale[mg]);
        for (int h = 0; h < 2; ++h) {
          const __m256i exact = _mm256_sub_epi32(iacc[m][h], shift);
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(ws[h], xs), acc[m][h]);
          if (mins) acc[m][h] = _mm256_fnmadd_ps(wm[h], _mm256_set1_ps(xsum[mg]), acc[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(y + (m0 + m) * N + t * TILE, acc[m][0]);
      _mm256_storeu_ps(y + (m0 + m) * N + t * TILE + 8, acc[m][1]);
    }
  }
}

struct Avx2 {
  static constexpr int MAX_ROWS = 4;  // input rows per pass over a tile: their accumulators fill the 16 ymm registers
  static Activations quantize(const float* x, int64_t rows, int64_t K, int64_t group) {
    return ::quantize(x, rows, K, group);
  }
  template <int BITS, typename Scale, int M>
  static void tiles(const Activations& a, int64_t m0, int64_t K, const uint8_t* packed, const Scale* scale,
                    const float* mins, int64_t group, int32_t zero, float* y, int64_t N, int64_t t0, int64_t t1) {
    tiles_kernel<BITS, Scale, M>(a, m0, K, packed, scale, mins, group, zero, y, N, t0, t1);
  }
};

}  // namespace

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_quant_avx2int8
#endif
TANDEM_INT8_TILES_LIBRARY(Avx2)
