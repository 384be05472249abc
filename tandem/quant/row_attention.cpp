// Attention of each query row alone over its own keys, in an order fixed per row: a verification
// pass's row gets bit for bit the output a one-token step at its position gets. The reference with
// the same semantics is target_service/ragged.py's _attend_one (plain float32 attention).
//
// Row i's keys are the cache positions [lo[i], hi[i]) followed by extra[i, :count[i]] (a token
// tree's path), in that order; head h reads kv head h / (heads / kv_heads). Scores are float32 dot
// products (eight accumulators over the vectors, a fixed tree, then the lanes), optionally
// soft-capped, softmaxed with the maximum subtracted (a polynomial exp, vectorised), normalised once,
// and the values summed in key order. Why not SDPA: a multi-row call sums in another order than a
// one-row call, and int8 activations (qmatmul_vnni.cpp) turn that rounding noise into changed tokens.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third of the build's time parsing every op
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"

namespace {

using namespace tandem_vec;

constexpr int64_t LANES_AT_ONCE = 8;  // independent accumulators: FMA latency times the FMA ports

// q . k over chunks * V floats: chunk c goes to accumulator c % 8, the accumulators are added in a
// fixed tree, then the lanes. Eight chains instead of one: a single accumulator waits out the FMA's
// latency on every chunk (the score loop was latency-bound).
inline float dot(const float* q, const float* k, int64_t chunks) {
  // Named accumulators, not an array: GCC zeroes a local vector array through memory on every call.
  vf s0{}, s1{}, s2{}, s3{}, s4{}, s5{}, s6{}, s7{};
  int64_t c = 0;
  for (; c + LANES_AT_ONCE <= chunks; c += LANES_AT_ONCE) {
    const float *qc = q + c * V, *kc = k + c * V;
    s0 += load(qc) * load(kc);
    s1 += load(qc + V) * load(kc + V);
    s2 += load(qc + 2 * V) * load(kc + 2 * V);
    s3 += load(qc + 3 * V) * load(kc + 3 * V);
    s4 += load(qc + 4 * V) * load(kc + 4 * V);
    s5 += load(qc + 5 * V) * load(kc + 5 * V);
    s6 += load(qc + 6 * V) * load(kc + 6 * V);
    s7 += load(qc + 7 * V) * load(kc + 7 * V);
  }
  const int64_t left = chunks - c;  // fewer than eight: accumulator u takes chunk c + u
  auto product = [&](int64_t u) { return load(q + (c + u) * V) * load(k + (c + u) * V); };
  if (left > 0) s0 += product(0);
  if (left > 1) s1 += product(1);
  if (left > 2) s2 += product(2);
  if (left > 3) s3 += product(3);
  if (left > 4) s4 += product(4);
  if (left > 5) s5 += product(5);
  if (left > 6) s6 += product(6);
  return lanes_sum(((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)));
}

// out[g * dim:][:dim] = sum over j in key order of w[g * stride + j] * values[index[j]], for PER heads
// that share the values: each element's sum runs over the keys in order (so the result does not
// depend on the blocking), a block of 8 / PER vectors of each head held in registers across the keys,
// each value vector read once for the PER heads.
template <int64_t PER>
void weigh_values(const float* w, int64_t stride, const float* vbase, const int64_t* index, int64_t n, int64_t chunks,
                  int64_t dim, float* out) {
  constexpr int64_t WIDTH = LANES_AT_ONCE / PER;
  for (int64_t c0 = 0; c0 < chunks; c0 += WIDTH) {
    const int64_t width = std::min<int64_t>(WIDTH, chunks - c0);
    vf acc[PER][WIDTH] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vbase + index[j] * dim + c0 * V;
      if (width == WIDTH) {
        for (int64_t u = 0; u < WIDTH; ++u) {
          const vf vv = load(v + u * V);
          for (int64_t g = 0; g < PER; ++g) acc[g][u] += w[g * stride + j] * vv;
        }
      } else {
        for (int64_t u = 0; u < width; ++u) {
          const vf vv = load(v + u * V);
          for (int64_t g = 0; g < PER; ++g) acc[g][u] += w[g * stride + j] * vv;
        }
      }
    }
    for (int64_t g = 0; g < PER; ++g)
      for (int64_t u = 0; u < width; ++u) store(out + g * dim + (c0 + u) * V, acc[g][u]);
  }
}

// weigh_values for ``per`` heads whose outputs are consecutive: in fours, twos, then ones.
void weigh_heads(const float* w, int64_t stride, const float* vbase, const int64_t* index, int64_t n, int64_t chunks,
                 int64_t dim, int64_t per, float* out) {
  int64_t g = 0;
  for (; g + 4 <= per; g += 4) weigh_values<4>(w + g * stride, stride, vbase, index, n, chunks, dim, out + g * dim);
  for (; g + 2 <= per; g += 2) weigh_values<2>(w + g * stride, stride, vbase, index, n, chunks, dim, out + g * dim);
  for (; g < per; ++g) weigh_values<1>(w + g * stride, stride, vbase, index, n, chunks, dim, out + g * dim);
}

at::Tensor row_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lo,
                         const at::Tensor& hi, const at::Tensor& extra, const at::Tensor& count, double scale,
                         double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.is_contiguous(), "query: [rows, heads, dim] float32");
  // keys/values may be views of a longer cache buffer: each kv head's [positions, dim] contiguous, the heads
  // at any stride (no copy of the cache per call).
  auto rows_packed = [](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  TORCH_CHECK(keys.dim() == 3 && keys.scalar_type() == at::kFloat && rows_packed(keys), "keys: [kv_heads, positions, dim] float32, each head's positions contiguous");
  TORCH_CHECK(values.sizes() == keys.sizes() && values.scalar_type() == at::kFloat && rows_packed(values), "values like keys");
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
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / (kv_heads * split), kvh = task / split % kv_heads, first = task % split * per;
      const int64_t contiguous = hip[r] - lop[r], n = contiguous + cp[r], padded = (n + V - 1) / V * V;
      index.resize(n);
      for (int64_t j = 0; j < contiguous; ++j) index[j] = lop[r] + j;
      for (int64_t j = 0; j < cp[r]; ++j) index[contiguous + j] = ep[r * width + j];
      weights.assign(per * padded, -INFINITY);
      const float* q0 = qp + (r * heads + kvh * group + first) * dim;  // the task's query heads, one after another
      const float* kbase = kp + kvh * keys.stride(0);
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kbase + index[j] * dim;
        for (int64_t g = 0; g < per; ++g) {
          float s = dot(q0 + g * dim, k, chunks) * fscale;
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
      const float* vbase = vp + kvh * values.stride(0);
      weigh_heads(weights.data(), padded, vbase, index.data(), n, chunks, dim, per,
                  op + (r * heads + kvh * group + first) * dim);
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
