// y = x @ W.T on AVX-512 VNNI, with the activations quantized to int8 per group, as llama.cpp does on
// CPUs: the integer products run as vpdpbusd (64 multiply-adds per instruction), so a pass over a
// weight costs about the same for one row as for eight, and verification stays close to the price of
// one decoding step. The reference with the same semantics is tandem/quant/reference.py
// (qmatmul_int8_activations).
//
// Semantics, per input row m and group g of `group` inputs:
//   sx[m, g] = max |x[m, k in g]| / 127,  xq[m, k] = round_half_even(x[m, k] * (127 / max)) in [-127, 127]
//   y[m, n]  = sum_g (scale[n, g] * sx[m, g]) * (sum_{k in g} (u[n, k] - zero) * xq[m, k])
//              - sum_g mins[n, g] * (sum_{k in g} x[m, k])
// with u the weight's unsigned integers (zero folds in GGUF's offsets). The integer sums are exact,
// and each output's float operations run in the same order whatever the number of rows, so a row's
// result depends on that row alone.
//
// Layout ("tiles16", made by tandem/quant/tensor.py's to_tiles): output rows in tiles of 16; per tile
// and group, the integers as zmm-sized blocks of [16 rows][4 inputs] bytes (vpdpbusd's operand):
//   bits 8: group / 4 blocks of 64 bytes
//   bits 4: group / 8 chunks of 64 bytes, block 2c in the low nibbles of chunk c, block 2c + 1 in the high
//   bits 5: the 4-bit chunks, then one uint64 per block whose bit (4 * row + i) is that byte's fifth bit
// scale and mins: [tiles, groups, 16] (float16 or float32; float32).
#include <immintrin.h>

#include "int8_tiles.h"

#include <cstdint>
#include <cstring>

namespace {

using tandem_int8::Activations;
using tandem_int8::TILE;

// Per group: max |x| (exact), q = nearest-even(x * (127 / max)) (vcvtps2dq in the default rounding
// mode, as torch.round), and the sums of q and of x (the latter in a fixed order: lanes, then a tree).
Activations quantize(const float* x, int64_t rows, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  Activations a = tandem_int8::empty_activations(rows, K, groups);
  int8_t* q = a.q.data_ptr<int8_t>();
  float* scale = a.scale.data_ptr<float>();
  int32_t* qsum = a.qsum.data_ptr<int32_t>();
  float* sum = a.sum.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + m * K + g * group;
      __m512 amax = _mm512_setzero_ps(), total = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16) {
        const __m512 v = _mm512_loadu_ps(xs + i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        total = _mm512_add_ps(total, v);
      }
      const float top = _mm512_reduce_max_ps(amax);
      const float inv = top > 0.f ? 127.f / top : 0.f;
      __m512i counted = _mm512_setzero_si512();
      for (int64_t i = 0; i < group; i += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + i), _mm512_set1_ps(inv)));
        counted = _mm512_add_epi32(counted, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + g * group + i), _mm512_cvtepi32_epi8(v));
      }
      scale[m * groups + g] = top / 127.f;
      qsum[m * groups + g] = _mm512_reduce_add_epi32(counted);
      sum[m * groups + g] = _mm512_reduce_add_ps(total);
    }
  }
  return a;
}

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Block j (16 rows x 4 inputs, unsigned bytes) of one tile's group.
template <int BITS>
inline __m512i block(const uint8_t* g, int j, int group) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(g + j * 64);
  } else {
    const __m512i chunk = _mm512_loadu_si512(g + (j / 2) * 64);
    const __m512i nib = _mm512_set1_epi8(15);
    __m512i v = (j & 1) ? _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nib) : _mm512_and_si512(chunk, nib);
    if constexpr (BITS == 5) {
      uint64_t bits;
      std::memcpy(&bits, g + group * 8 + j * 8, 8);
      v = _mm512_mask_add_epi8(v, (__mmask64)bits, v, _mm512_set1_epi8(16));
    }
    return v;
  }
}

template <int BITS, typename Scale, int M>
void tiles_kernel(const Activations& a, int64_t m0, int64_t K, const uint8_t* packed, const Scale* scale,
                  const float* mins, int64_t group, int32_t zero, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t groups = K / group;
  const int64_t group_bytes = BITS == 8 ? group * TILE : (BITS == 4 ? group * 8 : group * 10);
  const int blocks = (int)(group / 4);
  const int8_t* xq = a.q.data_ptr<int8_t>();
  const float* xscale = a.scale.data_ptr<float>();
  const int32_t* xqsum = a.qsum.data_ptr<int32_t>();
  const float* xsum = a.sum.data_ptr<float>();
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* tile = packed + t * groups * group_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* gp = tile + g * group_bytes;
      tandem_int8::prefetch_ahead(gp, group_bytes, scale, mins, t * groups + g);
      __m512i iacc[M];
      for (int m = 0; m < M; ++m) iacc[m] = _mm512_setzero_si512();
      for (int j = 0; j < blocks; ++j) {
        const __m512i w = block<BITS>(gp, j, (int)group);
        for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xq + (m0 + m) * K + g * group + 4 * j, 4);
          iacc[m] = _mm512_dpbusd_epi32(iacc[m], w, _mm512_set1_epi32(four));
        }
      }
      const __m512 ws = load_scales(scale + (t * groups + g) * TILE);
      const __m512 wm = mins ? _mm512_loadu_ps(mins + (t * groups + g) * TILE) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        const int64_t mg = (m0 + m) * groups + g;
        const __m512i exact = _mm512_sub_epi32(iacc[m], _mm512_set1_epi32(zero * xqsum[mg]));
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xscale[mg]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), s, acc[m]);
        if (mins) acc[m] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xsum[mg]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + (m0 + m) * N + t * TILE, acc[m]);
  }
}

struct Vnni {
  static constexpr int MAX_ROWS = 8;  // input rows per pass over a tile (their accumulators: 16 of 32 zmm)
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
#define TANDEM_QUANT_LIBRARY tandem_quant_avx512vnni
#endif
TANDEM_INT8_TILES_LIBRARY(Vnni)
