// What the int8-activation builds of the product share (qmatmul_vnni.cpp, qmatmul_int8_avx2.cpp): the
// activations' form, the argument checks and the dispatch over bits, scale types and row chunks. Each
// build supplies a Kernel with MAX_ROWS, quantize() and the tile loop tiles<BITS, Scale, M>(); the
// semantics and the layout are in qmatmul_vnni.cpp's header.
#pragma once

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third of the build's time parsing every op
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

namespace tandem_int8 {

constexpr int TILE = 16;
// Tiles per block: a block's weights (up to 8 x 16 rows x 2048 bytes) stay in cache while every chunk of
// MAX_ROWS input rows passes over them, so a long prompt chunk reads each weight from memory once.
constexpr int64_t TILES_PER_BLOCK = 8;

// How far ahead of its reads a tile loop asks for its weights (bytes of packed data). A decode step's
// products are many small passes over weights that come from memory; the hardware prefetchers learn
// each new stream only after its first misses, which a small product never amortises, so the loop
// names the lines it will read next itself (figures: benchmarks/RESULTS.md, 2026-12-03, "the int8 kernels prefetch").
constexpr int64_t PREFETCH_BYTES = 1024;

// Asks for the packed lines PREFETCH_BYTES past group gp and for the scales (and mins) of the group as
// far ahead; ``index`` is the group's place in the scale array ([tiles, groups, TILE]). Hints only:
// an address past the end is never read.
template <typename Scale>
inline void prefetch_ahead(const uint8_t* gp, int64_t group_bytes, const Scale* scale, const float* mins,
                           int64_t index) {
  for (int64_t line = 0; line < group_bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(gp + PREFETCH_BYTES + line), _MM_HINT_T0);
  const int64_t ahead = (index + PREFETCH_BYTES / group_bytes + 1) * TILE;
  _mm_prefetch(reinterpret_cast<const char*>(scale + ahead), _MM_HINT_T0);
  if (mins) _mm_prefetch(reinterpret_cast<const char*>(mins + ahead), _MM_HINT_T0);
}

struct Activations {
  at::Tensor q;       // [rows, K] int8
  at::Tensor scale;   // [rows, groups] float32: max / 127
  at::Tensor qsum;    // [rows, groups] int32: sum of q
  at::Tensor sum;     // [rows, groups] float32: sum of x
};

inline Activations empty_activations(int64_t rows, int64_t K, int64_t groups) {
  return {at::empty({rows, K}, at::kChar), at::empty({rows, groups}, at::kFloat), at::empty({rows, groups}, at::kInt),
          at::empty({rows, groups}, at::kFloat)};
}

template <class Kernel, int BITS, typename Scale, int M>
inline void chunk(const Activations& a, int64_t m0, int64_t K, const uint8_t* packed, const Scale* scale,
                  const float* mins, int64_t group, int32_t zero, float* y, int64_t N, int64_t t0, int64_t t1) {
  if constexpr (M <= Kernel::MAX_ROWS) {
    Kernel::template tiles<BITS, Scale, M>(a, m0, K, packed, scale, mins, group, zero, y, N, t0, t1);
  }
}

template <class Kernel, int BITS, typename Scale>
void run(const Activations& a, int64_t rows, int64_t K, const uint8_t* packed, const Scale* scale, const float* mins,
         int64_t group, int32_t zero, float* y, int64_t N) {
  static_assert(Kernel::MAX_ROWS >= 1 && Kernel::MAX_ROWS <= 8, "chunks of 1 to 8 rows");
  const int64_t tiles = N / TILE;
  at::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) {
    for (int64_t t0 = first; t0 < last; t0 += TILES_PER_BLOCK) {
      const int64_t t1 = std::min(last, t0 + TILES_PER_BLOCK);
      for (int64_t m0 = 0; m0 < rows; m0 += Kernel::MAX_ROWS) {
        switch (std::min<int64_t>(Kernel::MAX_ROWS, rows - m0)) {
#define TANDEM_ROWS(R) \
  case R: chunk<Kernel, BITS, Scale, R>(a, m0, K, packed, scale, mins, group, zero, y, N, t0, t1); break;
          TANDEM_ROWS(1) TANDEM_ROWS(2) TANDEM_ROWS(3) TANDEM_ROWS(4)
          TANDEM_ROWS(5) TANDEM_ROWS(6) TANDEM_ROWS(7) TANDEM_ROWS(8)
#undef TANDEM_ROWS
        }
      }
    }
  });
}

// y = x @ W.T for x [rows, in] float32 and W in the tiles layout; checks every argument first.
template <class Kernel>
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
  const Activations a = Kernel::quantize(x.data_ptr<float>(), x.size(0), K, group);
  const uint8_t* pp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const bool half = scale.scalar_type() == at::kHalf;
#define TANDEM_RUN(B)                                                                                             \
  if (bits == B) {                                                                                                \
    if (half) run<Kernel, B, at::Half>(a, x.size(0), K, pp, scale.data_ptr<at::Half>(), mp, group, (int32_t)zero,  \
                                       y.data_ptr<float>(), N);                                                   \
    else run<Kernel, B, float>(a, x.size(0), K, pp, scale.data_ptr<float>(), mp, group, (int32_t)zero,             \
                               y.data_ptr<float>(), N);                                                           \
  }
  TANDEM_RUN(4) TANDEM_RUN(5) TANDEM_RUN(8)
#undef TANDEM_RUN
  return y;
}

}  // namespace tandem_int8

// Through one more macro, so that TANDEM_QUANT_LIBRARY is expanded before TORCH_LIBRARY pastes it.
#define TANDEM_INT8_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_INT8_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

// Registers a build's qmatmul_tiles (a Kernel as above) in the library TANDEM_QUANT_LIBRARY names.
#define TANDEM_INT8_TILES_LIBRARY(Kernel)                                                                         \
  static at::Tensor qmatmul_tiles_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,       \
                                     const c10::optional<at::Tensor>& mins, int64_t group, int64_t bits,          \
                                     int64_t zero, int64_t out_features) {                                        \
    return tandem_int8::qmatmul_tiles<Kernel>(x, packed, scale, mins, group, bits, zero, out_features);            \
  }                                                                                                               \
  TANDEM_INT8_DEF(TANDEM_QUANT_LIBRARY, m) {                                                                      \
    m.def("qmatmul_tiles(Tensor x, Tensor packed, Tensor scale, Tensor? mins, int group, int bits, int zero, "     \
          "int out_features) -> Tensor");                                                                         \
  }                                                                                                               \
  TANDEM_INT8_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) { m.impl("qmatmul_tiles", &qmatmul_tiles_op); }
