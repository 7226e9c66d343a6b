// The experts of a sparse mixture-of-experts block as one op (Mixtral, Qwen3-MoE; pagoda/layers/moe.py).
//
// Each token chose k of E experts (the router's top-k, computed in torch). Here the (token, slot) pairs are
// grouped by expert, and each chosen expert runs once on all of its rows: gate|up, SiLU-and-mul, down,
// through the kernels a dense layer runs (format_linear, linear_formats.h). An expert's weights are read
// once a step however many tokens chose it, and an expert no token chose is not read at all: what makes a
// MoE model's decode step cost its active parameters, not its total.
//
// Each expert output row is scaled by its routing weight into its own fp32 (token, slot) row, and a token's
// k rows are summed in slot order, then rounded once to x's dtype: a token's result does not depend on
// which other tokens share the step (the reference, layers/moe.py moe_reference, sums in the same order).
//
// linears holds per expert e its gate_up (linear 2e) and down (linear 2e + 1) projections, four entries each
// (weight or codes, scales, offsets, bias), as the decoder stack takes them; formats, group_sizes and
// max_rows hold one value per linear. A linear given more rows than its max_rows does not run its few-row
// kernel: a dense weight runs at::linear, a row-major quantized one is dequantized (pagoda::quant_dequantize)
// for at::linear, as the Python paths do above their kernels' row limits (kernels/linear.py,
// kernels/quant_linear.py). Panel formats run every row count.

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_formats.h"
#include "ops.h"

namespace {

constexpr int64_t kEntriesPerLinear = 4, kLinearsPerExpert = 2;

// The float weight of a row-major quantized linear, in `dtype` (the registered op of quant_linear.cpp).
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                      int64_t fmt, int64_t group_size, at::ScalarType dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pagoda::quant_dequantize", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         int64_t, int64_t, int64_t, at::ScalarType)>();
  // Bytes per row of codes -> K: INT4 packs two a byte; INT4x8 holds 8 rows of K / 2 bytes per row of codes.
  const bool int4_rows = fmt == pagoda_cpu::kInt4 || fmt == pagoda_cpu::kInt4a8;
  const int64_t K = int4_rows ? 2 * codes.size(1) : fmt == pagoda_cpu::kInt4x8 ? codes.size(1) / 4 : codes.size(1);
  return op.call(codes, scales, offsets, fmt, group_size, K, dtype);
}

at::Tensor expert_linear(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& linears, int64_t index,
                         int64_t fmt, int64_t group_size, int64_t max_rows) {
  const int64_t base = index * kEntriesPerLinear;
  const c10::optional<at::Tensor> w = linears.get(base), scales = linears.get(base + 1),
                                  offsets = linears.get(base + 2), bias = linears.get(base + 3);
  TORCH_CHECK(w.has_value(), "moe_experts: linear ", index, " has no weight");
  if (x.size(0) <= max_rows) return pagoda_cpu::format_linear(x, *w, scales, offsets, bias, fmt, group_size);
  if (fmt == pagoda_cpu::kDense) return at::linear(x, *w, bias);
  TORCH_CHECK(fmt >= pagoda_cpu::kInt4 && fmt <= pagoda_cpu::kInt4a8 && scales.has_value(), "moe_experts: linear ",
              index, " (format ", fmt, ") has no path for ", x.size(0), " rows");
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(x.scalar_type());
  return at::linear(x, dequantize(*w, *scales, offsets, fmt, group_size, x.scalar_type()), b);
}

template <typename T>
void scale_rows(const at::Tensor& y, const int64_t* entries, const float* weights, float* contrib, int64_t H) {
  const T* src = y.data_ptr<T>();
  at::parallel_for(0, y.size(0), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = entries[i];
      const float w = weights[e];
      float* dst = contrib + e * H;
      const T* row = src + i * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(row[h]) * w;
    }
  });
}

template <typename T>
void sum_slots(const float* contrib, T* out, int64_t T_, int64_t k, int64_t H) {
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      const float* first = contrib + t * k * H;
      std::memcpy(acc.data(), first, H * sizeof(float));
      for (int64_t j = 1; j < k; ++j) {
        const float* row = first + j * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += row[h];
      }
      for (int64_t h = 0; h < H; ++h) out[t * H + h] = static_cast<T>(acc[h]);
    }
  });
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const c10::List<c10::optional<at::Tensor>>& linears, at::IntArrayRef formats,
                       at::IntArrayRef group_sizes, at::IntArrayRef max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_experts: x must be [T, H] contiguous");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "moe_experts: x must be float32 or bfloat16");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "moe_experts: topk_ids must be int64 [T, k] contiguous");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "moe_experts: topk_weights must be fp32 [T, k] contiguous, like topk_ids");
  const int64_t L = static_cast<int64_t>(formats.size()), E = L / kLinearsPerExpert;
  TORCH_CHECK(L % kLinearsPerExpert == 0 && static_cast<int64_t>(group_sizes.size()) == L &&
                  static_cast<int64_t>(max_rows.size()) == L &&
                  static_cast<int64_t>(linears.size()) == L * kEntriesPerLinear,
              "moe_experts: per-expert lists disagree (", L, " formats, ", group_sizes.size(), " group sizes, ",
              max_rows.size(), " row limits, ", linears.size(), " entries)");
  auto out = at::empty({T, H}, x.options());
  if (T == 0 || k == 0) return out.zero_();

  // Counting sort of the T * k (token, slot) entries by expert, stable: within an expert, in token order.
  const int64_t n_entries = T * k;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(n_entries);
  for (int64_t e = 0; e < n_entries; ++e) {
    TORCH_CHECK(ids[e] >= 0 && ids[e] < E, "moe_experts: expert id ", ids[e], " is not in [0, ", E, ")");
    ++start[ids[e] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t e = 0; e < n_entries; ++e) order[fill[ids[e]]++] = e;
  }

  auto contrib = at::empty({n_entries, H}, x.options().dtype(at::kFloat));
  float* cp = contrib.data_ptr<float>();
  const float* wp = topk_weights.data_ptr<float>();
  const auto* xp = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = H * static_cast<int64_t>(x.element_size());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* entries = order.data() + start[e];
    auto xe = at::empty({n, H}, x.options());
    auto* dst = static_cast<char*>(xe.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, xp + (entries[i] / k) * row_bytes, row_bytes);
    const int64_t g = kLinearsPerExpert * e, d = g + 1;
    at::Tensor h = expert_linear(xe, linears, g, formats[g], group_sizes[g], max_rows[g]);
    h = pagoda_cpu::silu_and_mul(h.contiguous());
    at::Tensor y = expert_linear(h, linears, d, formats[d], group_sizes[d], max_rows[d]).contiguous();
    TORCH_CHECK(y.dim() == 2 && y.size(0) == n && y.size(1) == H && y.scalar_type() == dt,
                "moe_experts: expert ", e, "'s down projection gave ", y.sizes(), ", not [", n, ", ", H, "]");
    if (dt == at::kFloat) scale_rows<float>(y, entries, wp, cp, H);
    else scale_rows<c10::BFloat16>(y, entries, wp, cp, H);
  }
  if (dt == at::kFloat) sum_slots(cp, out.data_ptr<float>(), T, k, H);
  else sum_slots(cp, out.data_ptr<c10::BFloat16>(), T, k, H);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor?[] linears, int[] formats, "
      "int[] group_sizes, int[] max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("moe_experts", &moe_experts); }
