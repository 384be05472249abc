// One Gemma 3 decoder layer over a session's rows in a single call, for a target on int8-activation
// tiles (the int8 product kernels): the products, the query/key norms with their rotary embedding,
// the cache write, the row attention, the gated activation and the norms, in the order
// target_service/gemma_pass.py runs them and through the very same functions (this file is compiled
// into one translation unit after the product kernel, row_attention.cpp and decoder_ops.cpp, and
// calls their code directly). So a layer computes bit for bit what the Python loop computes; what
// it saves is the Python between the calls (a dozen dispatches and views per layer).
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// The four products of a layer (q|k|v, o, gate|up, down), each in runs[i] runs of one weight format
// (Q4_K beside Q8_0, say: one kernel call each), the runs' outputs side by side. Run j is what the
// product kernel takes: packed[j], scale[j], mins[j] and meta[4 j : 4 j + 4] = (group, bits, zero,
// out_features).
struct Products {
  const c10::List<at::Tensor>& packed;
  const c10::List<at::Tensor>& scale;
  const c10::List<c10::optional<at::Tensor>>& mins;
  c10::IntArrayRef meta;
  c10::IntArrayRef runs;

  at::Tensor operator()(const at::Tensor& x, int64_t product) const {  // x [rows, in] -> [rows, sum of outs]
    int64_t first = 0;
    for (int64_t i = 0; i < product; ++i) first += runs[i];
    std::vector<at::Tensor> outs;
    for (int64_t j = first; j < first + runs[product]; ++j)
      outs.push_back(qmatmul_tiles_op(x, packed.get(j), scale.get(j), mins.get(j), meta[4 * j], meta[4 * j + 1],
                                      meta[4 * j + 2], meta[4 * j + 3]));
    return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  }
};

// hidden, normed [rows, hidden]: the residual stream and its input norm for this layer. norms: q_norm,
// k_norm, post_attention, pre_feedforward, post_feedforward, and the input norm of what follows (the
// next layer's, or the final norm). key_buffer / value_buffer [1, kv_heads, capacity, head_dim]: the
// session's cache of this layer, holding ``length`` positions; this call writes the rows' keys and
// values at [length, length + rows) (capacity must allow it) and each row attends its keys as lo, hi,
// extra, count give them (row_attention.cpp). Returns the new (hidden, normed).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& hidden, const at::Tensor& normed, const at::Tensor& cos, const at::Tensor& sin,
    const c10::List<at::Tensor>& packed, const c10::List<at::Tensor>& scale,
    const c10::List<c10::optional<at::Tensor>>& mins, c10::IntArrayRef meta, c10::IntArrayRef runs,
    const c10::List<at::Tensor>& norms,
    const at::Tensor& key_buffer, const at::Tensor& value_buffer, int64_t length, const at::Tensor& lo,
    const at::Tensor& hi, const at::Tensor& extra, const at::Tensor& count, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double eps, double scaling, double softcap) {
  TORCH_CHECK(runs.size() == 4, "four products");
  int64_t total = 0;
  for (const int64_t count : runs) {
    TORCH_CHECK(count >= 1, "a product of no weight");
    total += count;
  }
  TORCH_CHECK(packed.size() == total && scale.size() == total && mins.size() == total &&
                  (int64_t)meta.size() == 4 * total,
              "a weight's packed, scale, mins and four meta values for each run");
  const Products product{packed, scale, mins, meta, runs};
  TORCH_CHECK(norms.size() == 6, "six norms");
  const int64_t rows = normed.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  TORCH_CHECK(key_buffer.dim() == 4 && key_buffer.size(0) == 1 && key_buffer.size(1) == kv_heads &&
                  key_buffer.size(3) == head_dim && key_buffer.is_contiguous() &&
                  value_buffer.sizes() == key_buffer.sizes() && value_buffer.is_contiguous() &&
                  key_buffer.scalar_type() == at::kFloat &&
                  value_buffer.scalar_type() == at::kFloat,
              "key/value buffers: [1, kv_heads, capacity, head_dim] float32, contiguous");
  TORCH_CHECK(0 <= length && length + rows <= key_buffer.size(2), "the cache buffer has no room for the rows");
  const at::Tensor qkv = product(normed, 0);  // [rows, q + k + v widths]
  TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "q|k|v widths do not match the heads");
  const at::Tensor q =
      head_norm_rope(qkv.narrow(1, 0, q_width).view({rows, heads, head_dim}), norms.get(0), cos, sin, eps);
  const at::Tensor k = head_norm_rope(qkv.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim}), norms.get(1),
                                      cos, sin, eps);  // [rows, kv_heads, head_dim]
  const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
  const at::Tensor keys = key_buffer.select(0, 0), values = value_buffer.select(0, 0);  // [kv_heads, capacity, dim]
  keys.narrow(1, length, rows).copy_(k.transpose(0, 1));
  values.narrow(1, length, rows).copy_(v.transpose(0, 1));
  const at::Tensor attended = row_attention(q, keys.narrow(1, 0, length + rows), values.narrow(1, 0, length + rows), lo,
                                            hi, extra, count, scaling, softcap);  // [rows, heads, head_dim]
  const at::Tensor o = product(attended.view({rows, q_width}), 1);  // [rows, hidden]
  auto [middle, ff_in] = add_rms_norm(hidden, o, norms.get(2), norms.get(3), eps);
  const at::Tensor gate_up = product(ff_in, 2);  // [rows, 2 intermediate]
  const int64_t inner = gate_up.size(1) / 2;
  const at::Tensor gated = gelu_tanh_mul(gate_up.narrow(1, 0, inner), gate_up.narrow(1, inner, inner));
  const at::Tensor down = product(gated, 3);  // [rows, hidden]
  return add_rms_norm(middle, down, norms.get(4), norms.get(5), eps);
}

}  // namespace

#ifndef TANDEM_QUANT_LIBRARY
#define TANDEM_QUANT_LIBRARY tandem_decoder_layer
#endif
#define TANDEM_LAYER_DEF(ns, m) TORCH_LIBRARY(ns, m)
#define TANDEM_LAYER_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

TANDEM_LAYER_DEF(TANDEM_QUANT_LIBRARY, m) {
  m.def("decoder_layer(Tensor hidden, Tensor normed, Tensor cos, Tensor sin, Tensor[] packed, Tensor[] scale, "
        "Tensor?[] mins, int[] meta, int[] runs, Tensor[] norms, Tensor key_buffer, Tensor value_buffer, "
        "int length, Tensor lo, Tensor hi, Tensor extra, Tensor count, int heads, int kv_heads, int head_dim, "
        "float eps, float scaling, float softcap) -> (Tensor, Tensor)");
}

TANDEM_LAYER_IMPL(TANDEM_QUANT_LIBRARY, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
