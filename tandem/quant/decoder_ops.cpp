// The small elementwise and per-row steps of a decoder layer, each one call instead of the five to
// ten tensor operations transformers spells it in: on a decode step of a small model these
// operations, not their arithmetic, are what costs (each PyTorch call pays its dispatch).
// The references with the same semantics are in tandem/quant/reference.py (decoder_* functions).
//
// Invariant: every output row depends only on its own input row, in a fixed order of operations
// (sums of squares in double, in index order), so a verification pass's row is bit for bit the
// row a one-token step computes.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third of the build's time parsing every op
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "vector_math.h"

namespace {

using namespace tandem_vec;

void check_rows(const at::Tensor& x, int64_t dim, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), name, " must be contiguous float32");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == dim, name, " must end in ", dim, " columns");
}

// out[j] = x[j] / sqrt(mean(x^2) + eps) * weight[j], over one row of ``dim``.
inline void norm_row(const float* x, const float* weight, float eps, int64_t dim, float* out) {
  double squares = 0.0;
  for (int64_t j = 0; j < dim; ++j) squares += double(x[j]) * double(x[j]);
  const float inverse = 1.0f / std::sqrt(float(squares / double(dim)) + eps);
  for (int64_t j = 0; j < dim; ++j) out[j] = x[j] * inverse * weight[j];
}

// x [..., dim] -> the same shape, each row normalised and scaled by weight [dim].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t dim = weight.numel();
  check_rows(x, dim, "x");
  check_rows(weight, dim, "weight");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / dim;
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) norm_row(src + r * dim, weight.data_ptr<float>(), float(eps), dim, dst + r * dim);
  return out;
}

// hidden = residual + rms_norm(x, post); normed = rms_norm(hidden, pre): the end of a layer's half
// (its output norm and the residual) and the start of the next half (its input norm) in one call.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& x,
                                                const at::Tensor& post, const at::Tensor& pre, double eps) {
  const int64_t dim = post.numel();
  check_rows(residual, dim, "residual");
  check_rows(x, dim, "x");
  check_rows(post, dim, "post");
  check_rows(pre, dim, "pre");
  TORCH_CHECK(residual.numel() == x.numel(), "residual and x must have the same shape");
  at::Tensor hidden = at::empty_like(residual);
  at::Tensor normed = at::empty_like(residual);
  const int64_t rows = x.numel() / dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float* res = residual.data_ptr<float>() + r * dim;
    float* h = hidden.data_ptr<float>() + r * dim;
    norm_row(x.data_ptr<float>() + r * dim, post.data_ptr<float>(), float(eps), dim, h);
    for (int64_t j = 0; j < dim; ++j) h[j] = res[j] + h[j];
    norm_row(h, pre.data_ptr<float>(), float(eps), dim, normed.data_ptr<float>() + r * dim);
  }
  return {hidden, normed};
}

// x [rows, heads, dim] (rows may be strided: a slice of a joined product): each head's vector normalised (weight [dim]), then rotated by the row's
// cos/sin [rows, dim] (the "rotate half" convention: pairs (j, j + dim/2)).
at::Tensor head_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                          const at::Tensor& sin, double eps) {
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(2) == dim && dim % 2 == 0 && x.stride(2) == 1 &&
                  (x.size(1) == 1 || x.stride(1) == dim),
              "x must be float32 [rows, heads, even head_dim], each row's heads contiguous");
  check_rows(cos, dim, "cos");
  check_rows(sin, dim, "sin");
  const int64_t rows = x.size(0), heads = x.size(1), half = dim / 2;
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must be [rows, head_dim]");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  std::vector<float> buffer(dim);
  float* normed = buffer.data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos.data_ptr<float>() + r * dim;
    const float* s = sin.data_ptr<float>() + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      norm_row(x.data_ptr<float>() + r * x.stride(0) + h * dim, weight.data_ptr<float>(), float(eps), dim, normed);
      float* o = out.data_ptr<float>() + (r * heads + h) * dim;
      for (int64_t j = 0; j < half; ++j) o[j] = normed[j] * c[j] - normed[j + half] * s[j];
      for (int64_t j = half; j < dim; ++j) o[j] = normed[j] * c[j] + normed[j - half] * s[j];
    }
  }
  return out;
}

// gelu(gate) * up [rows, width] (rows may be strided) with gelu's tanh approximation, elementwise: 0.5 x (1 + tanh z) = x / (1 + e^(-2z)),
// z = sqrt(2/pi) (x + 0.044715 x^3), in vectors (a row's tail padded into one, so every element takes
// the same arithmetic wherever it sits).
inline vf gelu_mul(vf x, vf u) {
  const vf z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x * u / (1.0f + vexp(-2.0f * z));
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.dim() == 2 &&
                  gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate and up must be float32 [rows, width] of one shape, each row contiguous");
  const int64_t rows = gate.size(0), width = gate.size(1), body = width - width % V;
  at::Tensor out = at::empty({rows, width}, gate.options());
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate.data_ptr<float>() + r * gate.stride(0);
    const float* u = up.data_ptr<float>() + r * up.stride(0);
    float* o = out.data_ptr<float>() + r * width;
    for (int64_t j = 0; j < body; j += V) store(o + j, gelu_mul(load(g + j), load(u + j)));
    if (body < width) {
      float gt[V] = {}, ut[V] = {}, ot[V];
      std::memcpy(gt, g + body, (width - body) * 4);
      std::memcpy(ut, u + body, (width - body) * 4);
      store(ot, gelu_mul(load(gt), load(ut)));
      std::memcpy(o + body, ot, (width - body) * 4);
    }
  }
  return out;
}

// The index of a row's largest value as torch.argmax gives it: the first of equal maxima, and the
// first NaN where the row has one (NaN counts as the largest). One pass for the maximum (and
// whether a NaN is there), a second for its first position, which usually stops early.
inline int64_t row_argmax(const float* p, int64_t n) {
  const int64_t body = n - n % V;
  vf best = vf{} - __builtin_inff();
  vi nan = vi{};
  for (int64_t j = 0; j < body; j += V) {
    const vf v = load(p + j);
    nan |= v != v;
    best = v > best ? v : best;
  }
  float top = -__builtin_inff();
  bool has_nan = false;
  for (int i = 0; i < V; ++i) {
    top = best[i] > top ? best[i] : top;
    has_nan = has_nan || nan[i];
  }
  for (int64_t j = body; j < n; ++j) {
    top = p[j] > top ? p[j] : top;
    has_nan = has_nan || p[j] != p[j];
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (p[j] != p[j]) return j;
  }
  const vf target = vf{} + top;
  for (int64_t j = 0; j < body; j += V) {
    const vi hit = load(p + j) == target;
    for (int i = 0; i < V; ++i)
      if (hit[i]) return j + i;
  }
  for (int64_t j = body; j < n; ++j)
    if (p[j] == top) return j;
  return 0;  // not reached: top is one of the row's values (all -inf included)
}

// x [rows, n] (each row contiguous) -> [rows] int64, each row's argmax as torch.argmax(x, dim=1).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "x must be float32 [rows, n > 0], each row contiguous");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_argmax(base + r * stride, n);
  });
  return out;
}

// logits [rows, n] float32 (each row contiguous), bitmask [rows, ceil(n / 32)] int32 (bit j of word w:
// token 32 w + j is allowed) -> a contiguous copy of logits with every token not allowed at -inf.
// What a constrained session's verification scores (target_service/grammar.py): whole words of 32
// allowed or forbidden tokens, the common case, are copied or filled without looking at their bits.
at::Tensor mask_rows(const at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, n], each row contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), words = (n + 31) / 32;
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows && bitmask.size(1) == words,
              "bitmask must be contiguous int32 [rows, ceil(n / 32)]");
  at::Tensor out = at::empty({rows, n}, logits.options());
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* o = out.data_ptr<float>();
  const float forbidden = -__builtin_inff();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = base + r * stride;
      float* dst = o + r * n;
      const uint32_t* row_bits = bits + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const int64_t start = 32 * w, end = start + 32 < n ? start + 32 : n;
        const uint32_t word = row_bits[w];
        if (word == 0xFFFFFFFFu) {
          for (int64_t j = start; j < end; ++j) dst[j] = src[j];
        } else if (word == 0u) {
          for (int64_t j = start; j < end; ++j) dst[j] = forbidden;
        } else {
          for (int64_t j = start; j < end; ++j) dst[j] = (word >> (j - start)) & 1u ? src[j] : forbidden;
        }
      }
    }
  });
  return out;
}

}  // namespace

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_decoder_ops
#endif
#define TANDEM_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TANDEM_DEF(TANDEM_QUANT_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor x, Tensor post, Tensor pre, float eps) -> (Tensor, Tensor)");
  m.def("head_norm_rope(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("mask_rows(Tensor logits, Tensor bitmask) -> Tensor");
}

TANDEM_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("head_norm_rope", &head_norm_rope);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mask_rows", &mask_rows);
}
