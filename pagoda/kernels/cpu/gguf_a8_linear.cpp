// y = x @ dequant(w)^T (+ bias) for GGUF blocks (gguf_blocks.h's panels) with x quantized to int8 as llama.cpp
// quantizes it before its integer dot products (config quant_activations="int8"): per segment, each row of x is
// rounded per block of the type's act_block (gguf_a8.h) — Q8_K for the K-quants and IQ4_XS (256 values; the signed
// value of largest magnitude maps to -127, scale 1 / (-127 / max) in fp32), Q8_0 for the rest (32 values; scale
// amax / 127 rounded to fp16, codes round(x * 127 / amax), as ggml-cpu's x86 quantize_row_q8_0) — and each weight
// group's integer dot product with those int8 values (a micro-kernel per ISA, gguf_a8.h: exact, so the same integers
// on every build) closes into the row's fp32 sum as
//   y += (s dx) (dot - carry sum_q) + o (dx sum_q)
// with s and o the group's scale and offset (Blocks::group: gguf-py's d sc and -dmin m, or Q4_1's m), dx the block's
// activation scale and sum_q the group's sum of int8 values. That is one order per output at every row count (batch
// invariance) and on every build; rows are processed kA8Rows at a time, each sharing one decode of the codes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch_rows.h"
#include "gguf_a8.h"
#include "gguf_blocks.h"
#include "gguf_segments.h"
#include "simd.h"

namespace {

using pagoda_gguf::P;
using pagoda_simd::vf;
using pagoda_simd::vfma;
using pagoda_simd::vi;
using pagoda_simd::vsplat;
using pagoda_simd::W;

constexpr int kSumSpan = 16;  // the int8 values' sums are kept per 16 columns: the smallest weight group

// x [M, K] rounded per block of a type's act_block (256: Q8_K, 32: Q8_0): q int8 [M, K], dx fp32 [M, K / block],
// sums int32 [M, K / 16].
struct A8Rows {
  int64_t K = 0;
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> sums;
};

// ggml's quantize_row_q8_K_ref: max is the first value of largest magnitude; nearbyint rounds ties to even, as its
// nearest_int does.
void round_q8_k(const float* x, int8_t* q, float* dx) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 256; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  if (amax == 0.f) {
    std::memset(q, 0, 256);
    *dx = 0.f;
    return;
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < 256; ++j) q[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * x[j])));
  *dx = 1.f / iscale;
}

// ggml-cpu's x86 quantize_row_q8_0: the scale as the fp16 it stores, the codes from 127 / amax.
void round_q8_0(const float* x, int8_t* q, float* dx) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
  *dx = static_cast<float>(c10::Half(amax / 127.f));
}

template <typename X>
A8Rows quantize_rows(const X* x, int64_t M, int64_t K, int64_t block) {
  A8Rows a{K, std::vector<int8_t>(M * K), std::vector<float>(M * K / block),
           std::vector<int32_t>(M * K / kSumSpan)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(x[m * K + k]);
      for (int64_t b = 0; b < K / block; ++b)
        (block == 256 ? round_q8_k : round_q8_0)(row.data() + b * block, a.q.data() + m * K + b * block,
                                                 a.dx.data() + m * (K / block) + b);
      for (int64_t s = 0; s < K / kSumSpan; ++s) {
        int32_t t = 0;
        for (int j = 0; j < kSumSpan; ++j) t += a.q[m * K + s * kSumSpan + j];
        a.sums[m * (K / kSumSpan) + s] = t;
      }
    }
  });
  return a;
}

template <typename O>
inline void store_row(vf a, vf b, const float* bias, O* yr, int64_t col0) {
  float out[P];
  pagoda_simd::vstore(out, a);
  pagoda_simd::vstore(out + W, b);
  for (int c = 0; c < P; ++c) yr[c] = static_cast<O>(out[c] + (bias ? bias[col0 + c] : 0.f));
}

// W of a micro-kernel's integer sums less the carry's, exact, as fp32.
inline vf lanes_of(const int32_t* p, vi carry) {
  vi v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v - carry, vf);
}

// Rows [m0, m0 + R) of y for panel p. The group and activation block sizes are the type's constants, so that the
// epilogue's indices take no division.
template <int R, class Dots, typename O>
void panel_rows(const Dots& dots, const pagoda_gguf::Blocks<Dots::kType>& blocks, const A8Rows& a, int64_t m0,
                int64_t p, const float* bias, O* y, int64_t ldy) {
  constexpr int64_t gs = pagoda_gguf::Traits<Dots::kType>::kGroup, block = pagoda_gguf::act_block(Dots::kType);
  constexpr int64_t spans = gs / kSumSpan;
  const int64_t K = a.K;
  const int32_t* sums[R];
  const float* dxs[R];
  for (int r = 0; r < R; ++r) {
    sums[r] = a.sums.data() + (m0 + r) * (K / kSumSpan);
    dxs[r] = a.dx.data() + (m0 + r) * (K / block);
  }
  vf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
  alignas(64) int32_t out[R][P];
  for (int64_t g = 0; g < K / gs; ++g) {
    dots.template dots<R>(p, g, a.q.data() + m0 * K + g * gs, K, out);
    const auto grp = blocks.group(p, g);
    for (int r = 0; r < R; ++r) {
      int32_t sum_q = 0;
      for (int64_t s = 0; s < spans; ++s) sum_q += sums[r][g * spans + s];
      const float dx = dxs[r][g * gs / block];
      const vi carry = vi{} + Dots::kCarry * sum_q;
      acc[r][0] = vfma(lanes_of(out[r], carry), grp.s0 * dx, acc[r][0]);
      acc[r][1] = vfma(lanes_of(out[r] + W, carry), grp.s1 * dx, acc[r][1]);
      if (blocks.has_offsets()) {
        const vf xs = vsplat(dx * static_cast<float>(sum_q));
        acc[r][0] = vfma(grp.o0, xs, acc[r][0]);
        acc[r][1] = vfma(grp.o1, xs, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r][0], acc[r][1], bias, y + (m0 + r) * ldy + p * P, p * P);
}

// Rows [0, M) of y for panel p of a segment, kA8Rows at a time.
template <class Dots, typename O>
void panel(const Dots& dots, const pagoda_gguf::Blocks<Dots::kType>& blocks, const A8Rows& a, int64_t M, int64_t p,
           const float* bias, O* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += pagoda_gguf::kA8Rows)
    dispatch_m(std::min<int64_t>(pagoda_gguf::kA8Rows, M - m0),
               [&](auto c) { panel_rows<decltype(c)::value>(dots, blocks, a, m0, p, bias, y, ldy); });
}

// One segment as the parallel loop finds it.
struct Segment {
  int64_t type, row0, rows;
  const uint8_t* w;
};

}  // namespace

namespace pagoda_cpu {

// x: [M, K] fp32 or bf16; y: [M, N] in x's dtype. data, table: a GGUF weight in portable panels (gguf_segments.h).
// reference: the reference micro-kernel (RefDots), whose integers the build's own must equal (the tests).
at::Tensor gguf_a8_linear(const at::Tensor& x_in, const at::Tensor& data, const at::Tensor& table,
                          const c10::optional<at::Tensor>& bias, bool reference) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "gguf_a8_linear: x float32 or bfloat16 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = pagoda_gguf::segment_rows(table);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gguf_a8_linear: bias fp32 [N]");
  const at::Tensor x = x_in.contiguous();
  auto y = at::empty({M, N}, x_in.options());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // x rounded per 32 and per 256, as the segments' types need it; then every segment's panels in one parallel loop
  // (a fused weight's segments each in its own would pay a fork and join apiece, a decode step's worth).
  std::vector<Segment> segs;
  A8Rows by_block[2];
  pagoda_gguf::for_segments(data, table, K, [&](const auto& blocks, int64_t row0, int64_t rows) {
    constexpr int64_t T = std::decay_t<decltype(blocks)>::kType;
    segs.push_back({T, row0, rows, blocks.w});
    A8Rows& a = by_block[pagoda_gguf::act_block(T) == 256];
    if (a.K == 0 && M > 0) {
      if (x.scalar_type() == at::kFloat) a = quantize_rows(x.data_ptr<float>(), M, K, pagoda_gguf::act_block(T));
      else a = quantize_rows(x.data_ptr<c10::BFloat16>(), M, K, pagoda_gguf::act_block(T));
    }
  });
  if (M == 0) return y;
  at::parallel_for(0, N / P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q) {
      size_t i = 0;
      while ((segs[i].row0 + segs[i].rows) / P <= q) ++i;
      const Segment& seg = segs[i];
      const int64_t p = q - seg.row0 / P;
      pagoda_gguf::dispatch_type(seg.type, [&](auto c) {
        constexpr int64_t T = decltype(c)::value;
        const pagoda_gguf::Blocks<T> blocks(seg.w, K);
        const A8Rows& a = by_block[pagoda_gguf::act_block(T) == 256];
        const float* b = bp ? bp + seg.row0 : nullptr;
        auto go = [&](const auto& dots) {
          if (x.scalar_type() == at::kFloat) panel(dots, blocks, a, M, p, b, y.data_ptr<float>() + seg.row0, N);
          else panel(dots, blocks, a, M, p, b, y.data_ptr<c10::BFloat16>() + seg.row0, N);
        };
        if (reference) go(pagoda_gguf::RefDots<T>(seg.w, K));
        else pagoda_gguf::with_dots<T>(seg.w, K, go);
      });
    }
  });
  return y;
}

// x rounded as gguf_a8_linear rounds it for a weight of GGML type `type`, dequantized: fp32 [M, K] (q dx), the
// values its integer dot products multiply (the tests' reference).
at::Tensor gguf_a8_round(const at::Tensor& x_in, int64_t type) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "gguf_a8_round: x float32 [M, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), block = pagoda_gguf::act_block(type);
  TORCH_CHECK(K % block == 0, "gguf_a8_round: K ", K, " is not a multiple of ", block);
  const at::Tensor x = x_in.contiguous();
  const A8Rows a = quantize_rows(x.data_ptr<float>(), M, K, block);
  auto out = at::empty({M, K}, x.options());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) o[i] = static_cast<float>(a.q[i]) * a.dx[i / block];
  return out;
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("gguf_a8_linear(Tensor x, Tensor data, Tensor table, Tensor? bias, bool reference=False) -> Tensor");
  m.def("gguf_a8_round(Tensor x, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("gguf_a8_linear", &pagoda_cpu::gguf_a8_linear);
  m.impl("gguf_a8_round", &pagoda_cpu::gguf_a8_round);
}
