// Attention of each query row alone over its own keys, in an order fixed per row: a verification
// pass's row gets bit for bit the output a one-token step at its position gets. The reference with
// the same semantics is target_service/ragged.py's _attend_one (plain float32 attention).
//
// Row i's keys are the cache positions [lo[i], hi[i]) followed by extra[i, :count[i]] (a token
// tree's path), in that order; head h reads kv head h / (heads / kv_heads). Scores are float32 dot
// products (lanes, then a fixed tree), optionally soft-capped, softmaxed with the maximum subtracted
// (a polynomial exp, vectorised), normalised once, and the values summed in key order. Why not SDPA: a multi-row call sums in another order than a
// one-row call, and int8 activations (qmatmul_vnni.cpp) turn that rounding noise into changed tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;
#else
constexpr int V = 8;
#endif
typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

inline float lanes_sum(vf v) {
  // A fixed tree over the lanes (halves added until one lane is left).
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof(z));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
  __m256 h;
  std::memcpy(&h, &v, sizeof(h));
#endif
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// exp for a vector (Cephes' expf: 2^n times a degree-5 polynomial on the remainder), to ~1 ulp on
// the softmax's range (arguments <= 0); deterministic, as every operation here is.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f;
  x = x < lo ? lo : x;
  const vf t = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);
  vf fn = __builtin_convertvector(n, vf);
  const vi adjust = fn > t;  // truncation rounded negative values up: step down
  n += adjust;
  fn = __builtin_convertvector(n, vf);
  vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits;
  std::memcpy(&bits, &p, sizeof(vf));
  bits += (n << 23);
  std::memcpy(&p, &bits, sizeof(vf));
  return p;
}

at::Tensor row_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lo,
                         const at::Tensor& hi, const at::Tensor& extra, const at::Tensor& count, double scale,
                         double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(), "query: [rows, heads, dim] float32");
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && keys.is_contiguous(), "keys: [kv_heads, positions, dim] float32");
  TORCH_CHECK(values.sizes() == keys.sizes() && values.scalar_type() == at::kFloat && values.is_contiguous(), "values like keys");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), positions = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim && heads % kv_heads == 0 && dim % V == 0, "heads and dims must match (dim a multiple of ", V, ")");
  TORCH_CHECK(lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong && count.scalar_type() == at::kLong &&
              extra.scalar_type() == at::kLong && lo.numel() == rows && hi.numel() == rows && count.numel() == rows &&
              extra.dim() == 2 && extra.size(0) == rows && extra.is_contiguous(), "lo, hi, count: [rows] int64; extra: [rows, E] int64");
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* hip = hi.data_ptr<int64_t>();
  const int64_t* cp = count.data_ptr<int64_t>();
  const int64_t* ep = extra.data_ptr<int64_t>();
  const int64_t width = extra.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(0 <= lop[r] && lop[r] <= hip[r] && hip[r] <= positions && 0 <= cp[r] && cp[r] <= width, "bad key range");
    TORCH_CHECK(hip[r] - lop[r] + cp[r] > 0, "a row with no keys");
    for (int64_t j = 0; j < cp[r]; ++j) TORCH_CHECK(0 <= ep[r * width + j] && ep[r * width + j] < positions, "bad key index");
  }
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  const float* qp = query.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, chunks = dim / V;
  const float fscale = (float)scale, fcap = (float)softcap;
  // One task per (row, kv head), split by query head where there are fewer tasks than threads: each
  // key and value vector is read once for the heads of a task that share it.
  const int64_t split = rows * kv_heads >= at::get_num_threads() ? 1 : group;  // query heads per kv head split apart
  const int64_t per = group / split;
  at::parallel_for(0, rows * kv_heads * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> index;
    std::vector<float> weights;  // [group, n rounded up to V]
    std::vector<vf> acc(per * chunks);
    std::vector<vf> sums(per);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (kv_heads * split), kvh = task / split % kv_heads, first = task % split * per;
      const int64_t contiguous = hip[r] - lop[r], n = contiguous + cp[r], padded = (n + V - 1) / V * V;
      index.resize(n);
      for (int64_t j = 0; j < contiguous; ++j) index[j] = lop[r] + j;
      for (int64_t j = 0; j < cp[r]; ++j) index[contiguous + j] = ep[r * width + j];
      weights.assign(per * padded, -INFINITY);
      const float* q0 = qp + (r * heads + kvh * group + first) * dim;  // the task's query heads, one after another
      const float* kbase = kp + kvh * positions * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kbase + index[j] * dim;
        for (int64_t g = 0; g < per; ++g) sums[g] = vf{};
        for (int64_t c = 0; c < chunks; ++c) {
          const vf kv = load(k + c * V);
          for (int64_t g = 0; g < per; ++g) sums[g] += load(q0 + g * dim + c * V) * kv;
        }
        for (int64_t g = 0; g < per; ++g) {
          float s = lanes_sum(sums[g]) * fscale;
          if (fcap > 0) s = std::tanh(s / fcap) * fcap;
          weights[g * padded + j] = s;
        }
      }
      for (int64_t g = 0; g < per; ++g) {
        float* w = weights.data() + g * padded;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j]);
        vf totals = vf{};
        for (int64_t j = 0; j < padded; j += V) {
          const vf raw = load(w + j);
          vf e = vexp(raw - top);
          e = (raw == -INFINITY) ? vf{} : e;
          std::memcpy(w + j, &e, sizeof(vf));
          totals += e;
        }
        const float inverse = 1.f / lanes_sum(totals);
        for (int64_t j = 0; j < n; ++j) w[j] *= inverse;
      }
      for (auto& a : acc) a = vf{};
      const float* vbase = vp + kvh * positions * dim;
      for (int64_t j = 0; j < n; ++j) {
        const float* v = vbase + index[j] * dim;
        for (int64_t c = 0; c < chunks; ++c) {
          const vf vv = load(v + c * V);
          for (int64_t g = 0; g < per; ++g) acc[g * chunks + c] += weights[g * padded + j] * vv;
        }
      }
      for (int64_t g = 0; g < per; ++g)
        std::memcpy(op + (r * heads + kvh * group + first + g) * dim, acc.data() + g * chunks, dim * sizeof(float));
    }
  });
  return out;
}

}  // namespace

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_row_attention
#endif
#define TANDEM_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TANDEM_DEF(TANDEM_QUANT_LIBRARY, m) {
  m.def("row_attention(Tensor query, Tensor keys, Tensor values, Tensor lo, Tensor hi, Tensor extra, Tensor count, "
        "float scale, float softcap) -> Tensor");
}

TANDEM_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) { m.impl("row_attention", &row_attention); }
