// Batched multi-LoRA: y[t] += B_s (A_s x[t]) for each token t, with s the adapter slot of t's request (none: -1),
// the step's tokens of every adapter in one call (punica's SGMV on GPU does the same by segments).
//
// a is [S, Wd, in] and bt [S, Wd, out], fp32, with the scale folded into bt; slot s fills its first widths[s]
// rank rows (a fused Linear stacks its parts' ranks, lora/layer.py). x is the base Linear's input [T, in] and y
// its fresh output [T, out], both in the model's dtype (fp32 or bf16); y is updated in place, rounded once.
//
// Tokens are grouped by slot, up to kGroup tokens a group, so one pass over a slot's A and B (a few hundred kB,
// in cache) serves several tokens. Each token's sums are its own vector accumulators, reduced in one fixed
// order: a token's update is the same bits whatever other tokens, and however many, share the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec_bf16.h"

namespace {

using pagoda_simd::hsum;
using pagoda_simd::vf;
using pagoda_simd::vfma;
using pagoda_simd::vload;
using pagoda_simd::vload_as;
using pagoda_simd::vsplat;
using pagoda_simd::vstore_as;
using pagoda_simd::W;

constexpr int kGroup = 4;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

struct Group {
  int64_t first, count, slot;  // tokens order[first, first + count), all of slot `slot`
};

template <typename T>
void lora_add_rows(T* y, const T* x, const int64_t* token_slots, int64_t num_tokens, int64_t in, int64_t out,
                   const float* a, const float* bt, const int32_t* widths, int64_t num_slots, int64_t wd) {
  // Tokens by slot (a stable counting sort), then groups of up to kGroup tokens of one slot.
  std::vector<int64_t> count(num_slots + 1, 0), order;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (token_slots[t] >= 0 && widths[token_slots[t]] > 0) ++count[token_slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) count[s + 1] += count[s];
  order.resize(count[num_slots]);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (token_slots[t] >= 0 && widths[token_slots[t]] > 0) order[next[token_slots[t]]++] = t;
  std::vector<Group> groups;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += kGroup) groups.push_back({i, std::min<int64_t>(kGroup, count[s + 1] - i), s});
  if (groups.empty()) return;

  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> xs(kGroup * in), h(kGroup * wd);
    for (int64_t g = g0; g < g1; ++g) {
      const Group grp = groups[g];
      const int64_t n = grp.count, w = widths[grp.slot];
      const float* as = a + grp.slot * wd * in;
      const float* bs = bt + grp.slot * wd * out;
      for (int64_t i = 0; i < n; ++i) {
        const T* xr = x + order[grp.first + i] * in;
        for (int64_t k = 0; k < in; ++k) xs[i * in + k] = as_float(xr[k]);
      }
      // h[i][j] = A_s[j] . x_i: the vector part lane by lane, then the lanes, then the tail.
      for (int64_t j = 0; j < w; ++j) {
        const float* arow = as + j * in;
        vf acc[kGroup] = {};
        int64_t k = 0;
        for (; k + W <= in; k += W) {
          const vf av = vload(arow + k);
          for (int64_t i = 0; i < n; ++i) acc[i] = vfma(av, vload(&xs[i * in + k]), acc[i]);
        }
        for (int64_t i = 0; i < n; ++i) {
          float sum = hsum(acc[i]);
          for (int64_t kk = k; kk < in; ++kk) sum += arow[kk] * xs[i * in + kk];
          h[i * wd + j] = sum;
        }
      }
      // y_i += sum_j h[i][j] * B_s^T[j]: W outputs at a time, j in order.
      int64_t o = 0;
      for (; o + W <= out; o += W) {
        vf acc[kGroup] = {};
        for (int64_t j = 0; j < w; ++j) {
          const vf bv = vload(bs + j * out + o);
          for (int64_t i = 0; i < n; ++i) acc[i] = vfma(vsplat(h[i * wd + j]), bv, acc[i]);
        }
        for (int64_t i = 0; i < n; ++i) {
          T* yr = y + order[grp.first + i] * out + o;
          vstore_as(yr, vload_as(yr) + acc[i]);
        }
      }
      for (; o < out; ++o)
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0.f;
          for (int64_t j = 0; j < w; ++j) sum = __builtin_fmaf(h[i * wd + j], bs[j * out + o], sum);
          T* yv = y + order[grp.first + i] * out + o;
          *yv = static_cast<T>(as_float(*yv) + sum);
        }
    }
  });
}

}  // namespace

namespace pagoda_cpu {

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
               const at::Tensor& bt, const at::Tensor& widths) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add_: x [T, in] and y [T, out]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.scalar_type() == y.scalar_type(),
              "lora_add_: x and y contiguous, of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "lora_add_: fp32 or bf16 rows");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat &&
                  a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
                  a.size(2) == x.size(1) && bt.size(2) == y.size(1),
              "lora_add_: a [S, Wd, in] and bt [S, Wd, out], fp32, contiguous");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0) && token_slots.scalar_type() == at::kLong &&
                  token_slots.is_contiguous(),
              "lora_add_: token_slots [T] int64");
  TORCH_CHECK(widths.dim() == 1 && widths.size(0) == a.size(0) && widths.scalar_type() == at::kInt &&
                  widths.is_contiguous(),
              "lora_add_: widths [S] int32");
  const int64_t S = a.size(0), wd = a.size(1);
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int32_t* wid = widths.data_ptr<int32_t>();
  for (int64_t t = 0; t < x.size(0); ++t) TORCH_CHECK(slots[t] < S, "lora_add_: token slot ", slots[t], " >= ", S);
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(wid[s] >= 0 && wid[s] <= wd, "lora_add_: slot width out of range");
  if (x.scalar_type() == at::kFloat)
    lora_add_rows(y.data_ptr<float>(), x.data_ptr<float>(), slots, x.size(0), x.size(1), y.size(1),
                  a.data_ptr<float>(), bt.data_ptr<float>(), wid, S, wd);
  else
    lora_add_rows(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), slots, x.size(0), x.size(1), y.size(1),
                  a.data_ptr<float>(), bt.data_ptr<float>(), wid, S, wd);
}

}  // namespace pagoda_cpu

namespace {
void lora_add_op(at::Tensor y, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
                 const at::Tensor& bt, const at::Tensor& widths) {
  pagoda_cpu::lora_add_(y, x, token_slots, a, bt, widths);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor token_slots, Tensor a, Tensor bt, Tensor widths) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("lora_add_", &lora_add_op); }
