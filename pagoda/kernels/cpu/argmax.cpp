// Row-wise argmax of fp32 or bf16 logits [R, V], the same result as torch.argmax(dim=-1): the first index
// of the maximum, or of the first NaN where a row has one. torch's reduction tracks its index
// scalar by scalar (~80 us a row for a 49k vocabulary, 2.8 ms a step at 64 rows); here 16 lanes
// each keep their running maximum and its first index, and the lanes are merged at the end. bf16 rows
// are widened in registers (exactly), so greedy steps need no fp32 copy of the logits (1.3 ms at 64 rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec_bf16.h"

namespace {

inline float value(float v) { return v; }
inline float value(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t i = 0, best = 0;
  float best_v = V > 0 ? value(x[0]) : 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 mv = load16(x);
    __m512i mi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = mi;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = load16(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);  // strictly greater: lanes keep their first
      mv = _mm512_mask_mov_ps(mv, gt, v);
      mi = _mm512_mask_mov_epi32(mi, gt, idx);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    nan = unordered != 0;
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, mv);
    _mm512_store_si512(ids, mi);
    best_v = vals[0];
    best = ids[0];
    for (int l = 1; l < 16; ++l)
      if (vals[l] > best_v || (vals[l] == best_v && ids[l] < best)) { best_v = vals[l]; best = ids[l]; }
  }
#endif
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
