// Batched multi-LoRA: y[t] += B_s (A_s x[t]) for each token t, with s the adapter slot of t's request (none: -1),
// the step's tokens of every adapter in one call (punica's SGMV on GPU does the same by segments).
//
// a is [S, Wd, in] and bt [S, Wd, out], in the rows' dtype (fp32 or bf16), with the scale folded into bt; slot s
// fills its first widths[s] rank rows. parts [S, P, 4] says where each of a slot's parts sits (a fused Linear,
// q|k|v or gate|up, holds one per projection): rank columns [c, c + r) and output rows [o, o + n); only those
// blocks of bt are read, the rest of a fused Linear's bt being zeros. x is the base Linear's input [T, in] and y
// its fresh output [T, out]; y is updated in place, each value rounded once.
//
// Tokens are grouped by slot, up to kGroup tokens a group, so one pass over a slot's A and B serves several
// tokens: the op's cost is reading them. Each token's sums are its own vector accumulators, reduced in one fixed
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

constexpr int kGroup = 8;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

struct Group {
  int64_t first, count, slot;  // tokens order[first, first + count), all of slot `slot`
};

// One group's update: n tokens (rows order[0..n) of x and y) of one slot. n is a template argument so that each
// token's accumulators stay in registers.
template <typename T, int N>
void add_group(T* y, const float* xs, const int64_t* order, int64_t in, int64_t out, const T* as, const T* bs,
               int64_t w, const int32_t* slot_parts, int64_t num_parts, float* h) {
  // h[i][j] = A_s[j] . x_i: the vector part lane by lane, then the lanes, then the tail.
  for (int64_t j = 0; j < w; ++j) {
    const T* arow = as + j * in;
    vf acc[N] = {};
    int64_t k = 0;
    for (; k + W <= in; k += W) {
      const vf av = vload_as(arow + k);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) acc[i] = vfma(av, vload(xs + i * in + k), acc[i]);
    }
    for (int i = 0; i < N; ++i) {
      float sum = hsum(acc[i]);
      for (int64_t kk = k; kk < in; ++kk) sum = __builtin_fmaf(as_float(arow[kk]), xs[i * in + kk], sum);
      h[i * w + j] = sum;
    }
  }
  // Each part: y_i[o] += sum_j h[i][j] * B_s^T[j][o] over its rank columns and output rows, W outputs at a time.
  for (int64_t p = 0; p < num_parts; ++p) {
    const int32_t* pt = slot_parts + p * 4;
    const int64_t c0 = pt[0], c1 = pt[0] + pt[1], o1 = pt[2] + pt[3];
    int64_t o = pt[2];
    for (; o + W <= o1; o += W) {
      vf acc[N] = {};
      for (int64_t j = c0; j < c1; ++j) {
        const vf bv = vload_as(bs + j * out + o);
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i) acc[i] = vfma(vsplat(h[i * w + j]), bv, acc[i]);
      }
      for (int i = 0; i < N; ++i) {
        T* yr = y + order[i] * out + o;
        vstore_as(yr, vload_as(yr) + acc[i]);
      }
    }
    for (; o < o1; ++o)
      for (int i = 0; i < N; ++i) {
        float sum = 0.f;
        for (int64_t j = c0; j < c1; ++j) sum = __builtin_fmaf(h[i * w + j], as_float(bs[j * out + o]), sum);
        T* yv = y + order[i] * out + o;
        *yv = static_cast<T>(as_float(*yv) + sum);
      }
  }
}

template <typename T>
void lora_add_rows(T* y, const T* x, const int64_t* token_slots, int64_t num_tokens, int64_t in, int64_t out,
                   const T* a, const T* bt, const int32_t* widths, const int32_t* parts, int64_t num_slots,
                   int64_t wd, int64_t num_parts) {
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
      const int64_t* rows = order.data() + grp.first;
      for (int64_t i = 0; i < grp.count; ++i) {
        const T* xr = x + rows[i] * in;
        for (int64_t k = 0; k < in; ++k) xs[i * in + k] = as_float(xr[k]);
      }
      const T* as = a + grp.slot * wd * in;
      const T* bs = bt + grp.slot * wd * out;
      const int32_t* sp = parts + grp.slot * num_parts * 4;
      const int64_t w = widths[grp.slot];
      switch (grp.count) {
#define PAGODA_LORA_GROUP(n) \
  case n: add_group<T, n>(y, xs.data(), rows, in, out, as, bs, w, sp, num_parts, h.data()); break;
        PAGODA_LORA_GROUP(1) PAGODA_LORA_GROUP(2) PAGODA_LORA_GROUP(3) PAGODA_LORA_GROUP(4)
        PAGODA_LORA_GROUP(5) PAGODA_LORA_GROUP(6) PAGODA_LORA_GROUP(7) PAGODA_LORA_GROUP(8)
#undef PAGODA_LORA_GROUP
      }
    }
  });
}
static_assert(kGroup == 8, "add_group is instantiated for 1..8 tokens");

}  // namespace

namespace pagoda_cpu {

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
               const at::Tensor& bt, const at::Tensor& widths, const at::Tensor& parts) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add_: x [T, in] and y [T, out]");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && y.scalar_type() == dt && a.scalar_type() == dt &&
                  bt.scalar_type() == dt,
              "lora_add_: x, y, a and bt contiguous, of one dtype");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_add_: fp32 or bf16");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) &&
                  a.size(1) == bt.size(1) && a.size(2) == x.size(1) && bt.size(2) == y.size(1),
              "lora_add_: a [S, Wd, in] and bt [S, Wd, out]");
  TORCH_CHECK(token_slots.dim() == 1 && token_slots.size(0) == x.size(0) && token_slots.scalar_type() == at::kLong &&
                  token_slots.is_contiguous(),
              "lora_add_: token_slots [T] int64");
  const int64_t S = a.size(0), wd = a.size(1), out = y.size(1);
  TORCH_CHECK(widths.dim() == 1 && widths.size(0) == S && widths.scalar_type() == at::kInt && widths.is_contiguous(),
              "lora_add_: widths [S] int32");
  TORCH_CHECK(parts.dim() == 3 && parts.size(0) == S && parts.size(2) == 4 && parts.scalar_type() == at::kInt &&
                  parts.is_contiguous(),
              "lora_add_: parts [S, P, 4] int32");
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int32_t* wid = widths.data_ptr<int32_t>();
  const int32_t* pt = parts.data_ptr<int32_t>();
  const int64_t P = parts.size(1);
  for (int64_t t = 0; t < x.size(0); ++t) TORCH_CHECK(slots[t] < S, "lora_add_: token slot ", slots[t], " >= ", S);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(wid[s] >= 0 && wid[s] <= wd, "lora_add_: slot width out of range");
    for (int64_t p = 0; p < P; ++p) {
      const int32_t* q = pt + (s * P + p) * 4;
      TORCH_CHECK(q[0] >= 0 && q[1] >= 0 && q[0] + q[1] <= wid[s] && q[2] >= 0 && q[3] >= 0 && q[2] + q[3] <= out,
                  "lora_add_: a part out of its slot's range");
    }
  }
  if (dt == at::kFloat)
    lora_add_rows(y.data_ptr<float>(), x.data_ptr<float>(), slots, x.size(0), x.size(1), out, a.data_ptr<float>(),
                  bt.data_ptr<float>(), wid, pt, S, wd, P);
  else
    lora_add_rows(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), slots, x.size(0), x.size(1), out,
                  a.data_ptr<c10::BFloat16>(), bt.data_ptr<c10::BFloat16>(), wid, pt, S, wd, P);
}

}  // namespace pagoda_cpu

namespace {
void lora_add_op(at::Tensor y, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
                 const at::Tensor& bt, const at::Tensor& widths, const at::Tensor& parts) {
  pagoda_cpu::lora_add_(y, x, token_slots, a, bt, widths, parts);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor token_slots, Tensor a, Tensor bt, Tensor widths, Tensor parts) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("lora_add_", &lora_add_op); }
