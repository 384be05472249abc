// y = x @ W.T for a weight kept as group-quantized integers: W[n, k] = scale[n, g] * (q[n, k] - zero) - min[n, g]
// with g = k / group. The reference with the same arguments is tandem/quant/reference.py.
//
// Why it exists: decoding multiplies a few rows by every weight, so a pass costs what reading the
// weights costs. A GGUF checkpoint holds them at 4 to 8 bits; PyTorch's CPU kernels take int8 only
// with one scale per output row and int4 only, so they cannot compute on GGUF's group-wise blocks
// as they are. Here each weight vector is loaded as integers, widened to float32 and scaled, which
// gives bit for bit the float32 dequantization gguf-py computes (scale * q is exact in float32: a
// half-precision or 6-bit-times-half scale times an integer of at most 8 bits), and multiplied into
// float32 accumulators, one per input row. So the result is the float32 product of the dequantized
// weight up to the order of summation, and that order is fixed per output element: a row gets the
// same bits whatever other rows share the call (chunks of MAX_ROWS re-read the weight).
//
// Layouts, per output row n, per group of 32 along k (group 16 only for bits 8):
//   bits 8: int8 q[n, k], zero 0 (Q8_0, Q6_K: q is signed already)
//   bits 4: 16 bytes; byte i holds element i in its low nibble and element i + 16 in its high one
//   bits 5: the 4-bit layout above for the low bits, then one uint32 whose bit i is element i's 5th bit
// scale and min: [n, k / group], float32 or float16 (scale), float32 (min, optional).
//
// Vectors are GCC vector extensions; the file is compiled once per instruction set (-mavx512f or
// -mavx2 -mfma), chosen by tandem/quant/native.py from the CPU's capability.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third of the build's time parsing every op
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// Named, not only anonymous: tandem/quant/native.py builds this file in one translation unit with
// others whose own vf / vi (vector_math.h) this file's must not shadow.
namespace tandem_f32 {
namespace {

#if defined(__AVX512F__)
constexpr int V = 16;
typedef __m512 vf;
typedef __m512i vi;
#elif defined(__AVX2__)
constexpr int V = 8;
typedef __m256 vf;
typedef __m256i vi;
#else
#error "tandem_quant needs AVX2 or AVX-512"
#endif
constexpr int MAX_ROWS = 8;

inline vf load_x(const float* p) {
#if defined(__AVX512F__)
  return _mm512_loadu_ps(p);
#else
  return _mm256_loadu_ps(p);
#endif
}

// V int8 weights as float32 (vpmovsxbd, vcvtdq2ps).
inline vf widen_i8(const uint8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}

// Chunk c (elements c*V .. c*V+V-1) of one 32-element group of a 4- or 5-bit layout, less zero, as float32.
template <int BITS>
inline vf group_chunk(const uint8_t* g, int c, int32_t zero) {
  const int first = c * V;  // elements 0..15 are the low nibbles of bytes 0..15, 16..31 the high ones
  const __m128i nib = _mm_set1_epi8(15);
#if defined(__AVX512F__)
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
#else
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + (first & 15)));
#endif
  b = first >= 16 ? _mm_and_si128(_mm_srli_epi16(b, 4), nib) : _mm_and_si128(b, nib);
#if defined(__AVX512F__)
  vi v = _mm512_cvtepu8_epi32(b);
#else
  vi v = _mm256_cvtepu8_epi32(b);
#endif
  if constexpr (BITS == 5) {
    uint32_t h;
    std::memcpy(&h, g + 16, 4);
#if defined(__AVX512F__)
    v = _mm512_mask_add_epi32(v, (__mmask16)(h >> first), v, _mm512_set1_epi32(16));
#else
    const vi lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    vi bits = _mm256_srlv_epi32(_mm256_set1_epi32((int32_t)(h >> first)), lanes);
    v = _mm256_add_epi32(v, _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4));
#endif
  }
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(zero)));
#else
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(zero)));
#endif
}

// The sum of a vector's lanes, always in the same order (so an output's bits do not depend on the call).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  const __m256 h = v;
#endif
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline float to_float(float s) { return s; }
inline float to_float(at::Half s) { return _cvtsh_ss(s.x); }

// Output rows per tile. One is the fastest for up to four input rows (measured on AVX2 and AVX-512
// builds: a single row per tile streams the weight at memory speed); with AVX-512's 32 registers,
// two rows per tile win for five to eight. TANDEM_TILE_ROWS overrides it, to time other choices.
template <int M>
constexpr int tile_rows() {
#ifdef TANDEM_TILE_ROWS
  return TANDEM_TILE_ROWS;
#else
  return V == 16 && M > 4 ? 2 : 1;
#endif
}

// y[m, n] for m < M and the NT output rows from n: each weight vector is widened and scaled once and
// multiplied into all M rows' accumulators; each (m, n) sums its products in the same order whatever M and NT are.
template <int BITS, typename Scale, int M, int NT>
inline void tile(const float* x, int64_t K, const uint8_t* q, const Scale* scale, const float* mins, int64_t group,
                 int32_t zero, float* y, int64_t N, int64_t n) {
  constexpr int64_t kGroupBytes4 = 16, kGroupBytes5 = 20;
  const int64_t groups = K / group;
  const int64_t row_bytes = BITS == 8 ? K : (BITS == 4 ? K / 2 : K / 32 * kGroupBytes5);
  const int64_t group_bytes = BITS == 8 ? group : (BITS == 4 ? kGroupBytes4 : kGroupBytes5);
  const int chunks = (int)(group / V);
  vf acc[NT][M];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < M; ++m) acc[t][m] = vf{};
  for (int64_t gi = 0; gi < groups; ++gi) {
    vf s[NT], mn[NT];
    for (int t = 0; t < NT; ++t) {
      s[t] = vf{} + to_float(scale[(n + t) * groups + gi]);
      mn[t] = vf{} + (mins ? mins[(n + t) * groups + gi] : 0.f);
    }
    const int64_t k0 = gi * group;
    for (int c = 0; c < chunks; ++c) {
      vf w[NT];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* g = q + (n + t) * row_bytes + gi * group_bytes;
        w[t] = (BITS == 8 ? widen_i8(g + c * V) : group_chunk<BITS>(g, c, zero)) * s[t] - mn[t];  // exact dequantized weights
      }
      for (int m = 0; m < M; ++m) {
        const vf xv = load_x(x + m * K + k0 + c * V);
        for (int t = 0; t < NT; ++t) acc[t][m] += xv * w[t];
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < M; ++m) y[m * N + n + t] = hsum(acc[t][m]);
}

template <int BITS, typename Scale, int M>
void rows_kernel(const float* x, int64_t K, const uint8_t* q, const Scale* scale, const float* mins, int64_t group,
                 int32_t zero, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NT = tile_rows<M>();
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) tile<BITS, Scale, M, NT>(x, K, q, scale, mins, group, zero, y, N, n);
  for (; n < n1; ++n) tile<BITS, Scale, M, 1>(x, K, q, scale, mins, group, zero, y, N, n);
}

template <int BITS, typename Scale>
void dispatch_rows(int64_t rows, const float* x, int64_t K, const uint8_t* q, const Scale* scale, const float* mins,
                   int64_t group, int32_t zero, float* y, int64_t N, int64_t n0, int64_t n1) {
  switch (rows) {
#define TANDEM_ROWS(R) \
  case R: rows_kernel<BITS, Scale, R>(x, K, q, scale, mins, group, zero, y, N, n0, n1); break;
    TANDEM_ROWS(1) TANDEM_ROWS(2) TANDEM_ROWS(3) TANDEM_ROWS(4)
    TANDEM_ROWS(5) TANDEM_ROWS(6) TANDEM_ROWS(7) TANDEM_ROWS(8)
#undef TANDEM_ROWS
  }
}

template <int BITS, typename Scale>
void run(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const float* mins, int64_t group,
         int64_t zero, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const Scale* sp = reinterpret_cast<const Scale*>(scale.data_ptr());
  float* yp = y.data_ptr<float>();
  // Rows go in chunks of MAX_ROWS, each a pass over the weight; output rows are split among threads.
  for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
    const float* xm = xp + m0 * K;
    float* ym = yp + m0 * N;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      dispatch_rows<BITS, Scale>(rows, xm, K, qp, sp, mins, group, (int32_t)zero, ym, N, n0, n1);
    });
  }
}

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& mins,
                   int64_t group, int64_t bits, int64_t zero, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [rows, in] float32, contiguous");
  TORCH_CHECK(q.is_contiguous() && q.element_size() == 1, "q must be a contiguous byte tensor");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8");
  const int64_t K = x.size(1), N = out_features;
  TORCH_CHECK(group % V == 0 && K % group == 0, "group must divide in_features and be a multiple of ", V);
  TORCH_CHECK(bits == 8 || group == 32, "4- and 5-bit layouts have groups of 32");
  const int64_t row_bytes = bits == 8 ? K : (bits == 4 ? K / 2 : K / 32 * 20);
  TORCH_CHECK(q.numel() == N * row_bytes, "q holds ", q.numel(), " bytes, expected ", N * row_bytes);
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == N * (K / group), "scale must be [out, in / group]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf, "scale must be float32 or float16");
  const float* mp = nullptr;
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == scale.numel(),
                "min must be float32 [out, in / group]");
    mp = mins->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return y;
  const bool half = scale.scalar_type() == at::kHalf;
#define TANDEM_RUN(B)                                                 \
  if (bits == B) {                                                    \
    if (half) run<B, at::Half>(x, q, scale, mp, group, zero, y);     \
    else run<B, float>(x, q, scale, mp, group, zero, y);             \
  }
  TANDEM_RUN(4) TANDEM_RUN(5) TANDEM_RUN(8)
#undef TANDEM_RUN
  return y;
}

int64_t vector_width() { return V; }

}  // namespace
}  // namespace tandem_f32

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_quant
#endif
// Indirections, so that the library's name is the macro's value (a -D option when variants are timed).
#define TANDEM_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TANDEM_DEF(TANDEM_QUANT_LIBRARY, m) {
  m.def("qmatmul(Tensor x, Tensor q, Tensor scale, Tensor? mins, int group, int bits, int zero, int out_features) -> Tensor");
  m.def("vector_width() -> int");
}

TANDEM_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) { m.impl("qmatmul", &tandem_f32::qmatmul); }
TANDEM_IMPL(TANDEM_QUANT_LIBRARY, CatchAll, m) { m.impl("vector_width", &tandem_f32::vector_width); }
