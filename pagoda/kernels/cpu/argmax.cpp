// Row-wise argmax of fp32 or bf16 logits [R, V], the same result as torch.argmax(dim=-1): the first index
// of the maximum, or of the first NaN where a row has one. torch's reduction tracks its index
// scalar by scalar, slow over a whole vocabulary; here the W lanes of simd.h each keep their running maximum
// and its first index, and the lanes are merged at the end. bf16 rows are widened in registers (exactly), so
// greedy steps need no fp32 copy of the logits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec_bf16.h"

namespace {

using pagoda_simd::vf;
using pagoda_simd::vi;
using pagoda_simd::vload_as;
using pagoda_simd::W;

inline float value(float v) { return v; }
inline float value(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t i = 0, best = 0;
  float best_v = V > 0 ? value(x[0]) : 0.f;
  bool nan = false;
  if (V >= W) {
    vf mv = vload_as(x);
    vi idx, mi;
    for (int l = 0; l < W; ++l) idx[l] = l;
    mi = idx;
    vi unordered = mv != mv;
    for (i = W; i + W <= V; i += W) {
      idx += W;
      const vf v = vload_as(x + i);
      const vi gt = v > mv;  // strictly greater (false for NaN): lanes keep their first maximum
      mv = gt ? v : mv;
      mi = gt ? idx : mi;
      unordered |= v != v;
    }
    for (int l = 0; l < W; ++l) nan |= unordered[l] != 0;
    best_v = mv[0];
    best = mi[0];
    for (int l = 1; l < W; ++l)
      if (mv[l] > best_v || (mv[l] == best_v && mi[l] < best)) { best_v = mv[l]; best = mi[l]; }
  }
  for (; i < V && !nan; ++i) {
    const float v = value(x[i]);
    if (std::isnan(v)) nan = true;
    else if (v > best_v) { best_v = v; best = i; }
  }
  if (nan || std::isnan(best_v))
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(value(x[j]))) return j;
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1,
              "argmax_rows: x must be fp32 or bf16 [R, V] with a contiguous last dim");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "argmax_rows: 0 < V < 2^31");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto rows = [&](const auto* xp) {
    at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * ld, V);
    });
  };
  if (x.scalar_type() == at::kFloat) rows(x.const_data_ptr<float>());
  else rows(x.const_data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
