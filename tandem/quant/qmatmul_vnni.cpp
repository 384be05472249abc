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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int TILE = 16;
constexpr int MAX_ROWS = 8;

struct Activations {
  at::Tensor q;       // [rows, K] int8
  at::Tensor scale;   // [rows, groups] float32: max / 127
  at::Tensor qsum;    // [rows, groups] int32: sum of q
  at::Tensor sum;     // [rows, groups] float32: sum of x
};

// Per group: max |x| (exact), q = nearest-even(x * (127 / max)) (vcvtps2dq in the default rounding
// mode, as torch.round), and the sums of q and of x (the latter in a fixed order: lanes, then a tree).
Activations quantize(const float* x, int64_t rows, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  Activations a{at::empty({rows, K}, at::kChar), at::empty({rows, groups}, at::kFloat),
                at::empty({rows, groups}, at::kInt), at::empty({rows, groups}, at::kFloat)};
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

// Tiles per block: a block's weights (up to 8 x 16 rows x 2048 bytes) stay in cache while every chunk of
// MAX_ROWS input rows passes over them, so a long prompt chunk reads each weight from memory once.
constexpr int64_t TILES_PER_BLOCK = 8;

template <int BITS, typename Scale>
void run(const Activations& a, int64_t rows, int64_t K, const uint8_t* packed, const Scale* scale, const float* mins,
         int64_t group, int32_t zero, float* y, int64_t N) {
  const int64_t tiles = N / TILE;
  at::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) {
    for (int64_t t0 = first; t0 < last; t0 += TILES_PER_BLOCK) {
      const int64_t t1 = std::min(last, t0 + TILES_PER_BLOCK);
      for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) {
        switch (std::min<int64_t>(MAX_ROWS, rows - m0)) {
#define TANDEM_ROWS(R) \
  case R: tiles_kernel<BITS, Scale, R>(a, m0, K, packed, scale, mins, group, zero, y, N, t0, t1); break;
          TANDEM_ROWS(1) TANDEM_ROWS(2) TANDEM_ROWS(3) TANDEM_ROWS(4)
          TANDEM_ROWS(5) TANDEM_ROWS(6) TANDEM_ROWS(7) TANDEM_ROWS(8)
#undef TANDEM_ROWS
        }
      }
    }
  });
}

at::Tensor qmatmul_tiles(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& mins, int64_t group, int64_t bits, int64_t zero,
                         int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [rows, in] float32, contiguous");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  const int64_t K = x.size(1), N = out_features;
  TORCH_CHECK(N % TILE == 0, "out_features must be a multiple of ", TILE);
  TORCH_CHECK(group % 16 == 0 && K % group == 0 && (bits == 8 || group == 32), "bad group ", group, " for ", bits, " bits");
  const int64_t groups = K / group;
  const int64_t group_bytes = bits == 8 ? group * TILE : (bits == 4 ? group * 8 : group * 10);
  TORCH_CHECK(packed.is_contiguous() && packed.element_size() == 1 && packed.numel() == N / TILE * groups * group_bytes,
              "packed holds ", packed.numel(), " bytes, expected ", N / TILE * groups * group_bytes);
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == N * groups &&
              (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf), "scale must be [tiles, groups, 16]");
  const float* mp = nullptr;
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == N * groups, "bad mins");
    mp = mins->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const Activations a = quantize(x.data_ptr<float>(), x.size(0), K, group);
  const uint8_t* pp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const bool half = scale.scalar_type() == at::kHalf;
#define TANDEM_RUN(B)                                                                                         \
  if (bits == B) {                                                                                            \
    if (half) run<B, at::Half>(a, x.size(0), K, pp, scale.data_ptr<at::Half>(), mp, group, (int32_t)zero, y.data_ptr<float>(), N); \
    else run<B, float>(a, x.size(0), K, pp, scale.data_ptr<float>(), mp, group, (int32_t)zero, y.data_ptr<float>(), N);            \
  }
  TANDEM_RUN(4) TANDEM_RUN(5) TANDEM_RUN(8)
#undef TANDEM_RUN
  return y;
}

}  // namespace

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_quant_avx512vnni
#endif
#define TANDEM_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TANDEM_DEF(TANDEM_QUANT_LIBRARY, m) {
  m.def("qmatmul_tiles(Tensor x, Tensor packed, Tensor scale, Tensor? mins, int group, int bits, int zero, int out_features) -> Tensor");
}

TANDEM_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) { m.impl("qmatmul_tiles", &qmatmul_tiles); }
