// y = x @ dequant(w)^T (+ bias) for quantized weights in portable panels: the builds without the AVX512-BF16 panel
// kernel (quant_panel_linear.cpp) run this one at every row count (avx2, Arm), written once in simd.h's vectors.
//
// Layout (PackedWeight.vpanels, kernels/quant_linear.py), per panel of P = 2W output columns (W: simd.h's lanes):
//   int4 (kind 0): codes uint8 [N / P, K, W]: byte j of column k holds column j (low nibble) and column j + W (high)
//   int8 (kind 1): codes int8 [N / P, K, P];  fp8 (kind 2): e4m3 bytes [N / P, K, P] (per-channel scales)
//   scales, offsets: fp32 or fp16 [N / P, G, P] (w = code * s + o; fp16 where every one is an fp16 number, as a
//   GGUF stores them: widened exactly, half the bytes)
// Every output column owns a lane: per k a panel's codes become two fp32 vectors and each activation row's x[k],
// broadcast, is FMA'd into the group's dot product, one chain per (row, vector) in k order; at the group's end the
// chain times the group's scales goes into the running sum, then the offsets times the row's group sum of x (sum_g
// s_g sum_k q x + o_g sum_k x, which is x . (q s + o)). One FMA a weight where scaling each decoded code first would take
// two, which pays at one row, where decoding bounds the kernel (docs/benchmarks.md). No horizontal sums. That order is
// the sum's one order whatever the row count (batch invariance): up to four rows the codes are decoded in registers
// as they stream (two panels at a time at one row); more rows decode each panel once into an fp32 tile [K][P] that
// stays in L1/L2 and run every pass over it (the same values, loaded instead of decoded), kRowsPerPass rows at a
// time (6 on AVX2: 12 accumulators, two code vectors and a broadcast in its 16 registers), the outer-product tile a
// GEMM runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "dispatch_rows.h"
#include "gguf_blocks.h"
#include "gguf_segments.h"
#include "linear_formats.h"
#include "ops.h"
#include "quant_decode.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using pagoda_simd::vf;
using pagoda_simd::vfma;
using pagoda_simd::vload;
using pagoda_simd::vsplat;
using pagoda_simd::vstore;
using pagoda_simd::W;

constexpr int P = 2 * W;            // output columns per panel
// Activation rows per pass over a tile: 2 x kRowsPerPass accumulators, two weight vectors and a broadcast must fit
// the register file (AVX2's and NEON's 16 and 32 vectors: 6; AVX-512's 32: 12).
constexpr int kRowsPerPass = W == 16 ? 12 : 6;
constexpr int kStreamRows = 4;      // up to this many rows the weights are decoded as they stream
// kind = the format's storage (LinearFormat kInt4, kInt8, kFp8: 0, 1, 2), what decode_codes takes
using pagoda_cpu::kFp8;
using pagoda_cpu::kInt4;
using pagoda_cpu::kInt8;

constexpr int64_t bytes_per_k(int F) { return F == kInt4 ? W : P; }

// A panel's codes at column k as two fp32 vectors (lo: columns [0, W), hi: [W, 2W)), and a group's scales and
// offsets as vectors.
template <int F, typename S>  // S: float, or uint16_t (fp16 bits)
struct Codes {
  static constexpr int kFormat = F;
  const uint8_t* w;
  const S* scales;
  const S* offsets;  // or null
  int64_t K, G, gs;

  bool has_offsets() const { return offsets != nullptr; }
  inline void prefetch(int64_t p, int64_t k) const {
    __builtin_prefetch(w + (p * K + k + 64) * bytes_per_k(F), 0, 3);
  }

  static vf lanes(const float* p) { return vload(p); }
  static vf lanes(const uint16_t* p) { return pagoda_simd::vload_half(p); }

  struct Group {
    vf s0, s1, o0, o1;
  };
  inline Group group(int64_t p, int64_t g) const {
    const S* s = scales + (p * G + g) * P;
    Group r{lanes(s), lanes(s + W), vf{}, vf{}};
    if (offsets) {
      r.o0 = lanes(offsets + (p * G + g) * P);
      r.o1 = lanes(offsets + (p * G + g) * P + W);
    }
    return r;
  }
  inline void load(int64_t p, int64_t k, vf& lo, vf& hi) const {
    pagoda_simd::decode_codes<F>(w + (p * K + k) * bytes_per_k(F), lo, hi);
  }
};

// The end of group g for one row's output vectors: the group's code dot products (ga, gb), times its scales, into the
// running sums (a, b), then its offsets times the row's group sum of x. The one order every path keeps.
template <class Grp>
inline void close_group(const Grp& grp, bool offsets, float xsum, vf ga, vf gb, vf& a, vf& b) {
  a = vfma(ga, grp.s0, a);
  b = vfma(gb, grp.s1, b);
  if (offsets) {
    a = vfma(grp.o0, vsplat(xsum), a);
    b = vfma(grp.o1, vsplat(xsum), b);
  }
}

template <typename O>
inline void store_row(vf a, vf b, const float* bias, O* yr, int64_t col0) {
  float out[P];
  vstore(out, a);
  vstore(out + W, b);
  for (int c = 0; c < P; ++c) yr[c] = static_cast<O>(out[c] + (bias ? bias[col0 + c] : 0.f));
}

// y[m, p * P + c] for rows [0, M) and panels [p0, p1), R panels at a time, decoding as the codes stream.
template <class Src, int M, int R, typename O>
void stream(const Src& src, const float* x, const float* xs, const float* bias, O* y, int64_t ldy, int64_t p0,
            int64_t p1) {
  const int64_t K = src.K, G = src.G, gs = src.gs;
  const bool offsets = src.has_offsets();
  int64_t p = p0;
  for (; p + R <= p1; p += R) {
    vf acc[R][M][2];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = vf{};
    for (int64_t g = 0; g < G; ++g) {
      vf gacc[R][M][2];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) gacc[r][m][0] = gacc[r][m][1] = vf{};
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
        vf lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          src.prefetch(p + r, k);
          src.load(p + r, k, lo[r], hi[r]);
        }
        for (int m = 0; m < M; ++m) {
          const vf xv = vsplat(x[m * K + k]);
          for (int r = 0; r < R; ++r) {
            gacc[r][m][0] = vfma(lo[r], xv, gacc[r][m][0]);
            gacc[r][m][1] = vfma(hi[r], xv, gacc[r][m][1]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const auto grp = src.group(p + r, g);
        for (int m = 0; m < M; ++m)
          close_group(grp, offsets, offsets ? xs[m * G + g] : 0.f, gacc[r][m][0], gacc[r][m][1], acc[r][m][0],
                      acc[r][m][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) store_row(acc[r][m][0], acc[r][m][1], bias, y + m * ldy + (p + r) * P, (p + r) * P);
  }
  if constexpr (R > 1) {
    if (p < p1) stream<Src, M, 1>(src, x, xs, bias, y, ldy, p, p1);
  }
}

// The same sums over one panel's decoded codes [K][P] (fp32), M rows at a time.
template <int M, class Src, typename O>
void tile_rows(const Src& src, const float* tile, const float* x, const float* xs, const float* bias, O* y,
               int64_t ldy, int64_t p) {
  const int64_t K = src.K, G = src.G, gs = src.gs;
  const bool offsets = src.has_offsets();
  vf run_sums[M][2];
  for (int m = 0; m < M; ++m) run_sums[m][0] = run_sums[m][1] = vf{};
  for (int64_t g = 0; g < G; ++g) {
    vf acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vf{};
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const vf lo = vload(tile + k * P), hi = vload(tile + k * P + W);
      for (int m = 0; m < M; ++m) {
        const vf xv = vsplat(x[m * K + k]);
        acc[m][0] = vfma(lo, xv, acc[m][0]);
        acc[m][1] = vfma(hi, xv, acc[m][1]);
      }
    }
    const auto grp = src.group(p, g);
    for (int m = 0; m < M; ++m)
      close_group(grp, offsets, offsets ? xs[m * G + g] : 0.f, acc[m][0], acc[m][1], run_sums[m][0], run_sums[m][1]);
  }
  for (int m = 0; m < M; ++m) store_row(run_sums[m][0], run_sums[m][1], bias, y + m * ldy + p * P, p * P);
}

// A pass's row count (1..kRowsPerPass) as a compile-time constant, so its accumulators live in registers.
template <typename Fn>
inline void dispatch_pass(int64_t m, Fn&& fn) {
  if (m > 8) {
    switch (m) {
      case 9: fn(std::integral_constant<int, 9>{}); return;
      case 10: fn(std::integral_constant<int, 10>{}); return;
      case 11: fn(std::integral_constant<int, 11>{}); return;
      default: fn(std::integral_constant<int, 12>{}); return;
    }
  }
  dispatch_m(m, fn);
}

// y[m, c] for the N columns of `src` (ldy apart, bias indexed from the first of them): the driver every format's
// decoder plugs into (Codes above, gguf_blocks.h's Blocks).
template <class Src, typename O>
void run(const Src& src, const float* x, const float* bias, O* y, int64_t M, int64_t N, int64_t ldy) {
  const int64_t panels = N / P, K = src.K, G = src.G, gs = src.gs;
  const std::vector<float> xs = src.has_offsets() ? pagoda_simd::group_sums(x, M, K, gs) : std::vector<float>();
  if (M <= kStreamRows) {
    at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
      switch (M) {
        case 1: stream<Src, 1, 2>(src, x, xs.data(), bias, y, ldy, p0, p1); break;
        case 2: stream<Src, 2, 1>(src, x, xs.data(), bias, y, ldy, p0, p1); break;
        case 3: stream<Src, 3, 1>(src, x, xs.data(), bias, y, ldy, p0, p1); break;
        default: stream<Src, 4, 1>(src, x, xs.data(), bias, y, ldy, p0, p1); break;
      }
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> tile(K * P);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t k = 0; k < K; ++k) {
        vf lo, hi;
        src.load(p, k, lo, hi);
        vstore(tile.data() + k * P, lo);
        vstore(tile.data() + k * P + W, hi);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
        dispatch_pass(std::min<int64_t>(kRowsPerPass, M - m0), [&](auto c) {
          tile_rows<decltype(c)::value>(src, tile.data(), x + m0 * K, xs.data() + (src.has_offsets() ? m0 * G : 0),
                                        bias, y + m0 * ldy, ldy, p);
        });
    }
  });
}

int64_t vpanel_width() { return P; }

bool quant_vpanels_supported(int64_t K, int64_t group_size) {
  return group_size > 0 && K % group_size == 0;
}

}  // namespace

namespace pagoda_cpu {

// x: [M, K] fp32 or bf16 (widened); y: [M, N] in x's dtype, fp32 sums. kind: 0 INT4, 1 INT8, 2 FP8 (the layout above).
at::Tensor quant_vpanel_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                               int64_t group_size, int64_t kind) {
  TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 3 && codes.is_contiguous(), "quant_vpanel_linear: x [M, K], codes "
              "[N / P, K, bytes]");
  TORCH_CHECK(kind >= kInt4 && kind <= kFp8, "quant_vpanel_linear: unknown kind ", kind);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quant_vpanel_linear: x must be float32 or bfloat16");
  const int64_t M = x_in.size(0), K = x_in.size(1), panels = codes.size(0), N = panels * P;
  TORCH_CHECK(codes.size(1) == K && codes.size(2) == (kind == kInt4 ? W : P), "quant_vpanel_linear: codes must be [",
              panels, ", ", K, ", ", kind == kInt4 ? W : P, "] for panels of ", P, " columns");
  TORCH_CHECK(quant_vpanels_supported(K, group_size), "quant_vpanel_linear: K ", K, " / group ", group_size);
  const int64_t G = K / group_size;
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() && scales.numel() == N * G,
              "quant_vpanel_linear: scales fp32 or fp16 [N / P, G, P]");
  if (offsets.has_value())
    TORCH_CHECK(offsets->scalar_type() == scales.scalar_type() && offsets->is_contiguous() &&
                offsets->numel() == N * G, "quant_vpanel_linear: offsets [N / P, G, P] in the scales' dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_vpanel_linear: bias fp32 [N]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x_in.options());
  const auto* wp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const void* sp = scales.data_ptr();
  const void* op = offsets.has_value() ? offsets->data_ptr() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto go = [&](auto* yp) {
    pagoda_simd::dispatch_codes(kind, [&](auto f) {
      constexpr int F = decltype(f)::value;
      auto with = [&](auto* s) {
        using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
        run(Codes<F, S>{wp, s, static_cast<const S*>(op), K, G, group_size}, x.data_ptr<float>(), bp, yp, M, N, N);
      };
      if (half) with(static_cast<const uint16_t*>(sp));
      else with(static_cast<const float*>(sp));
    });
  };
  if (x_in.scalar_type() == at::kFloat) go(y.data_ptr<float>());
  else go(y.data_ptr<c10::BFloat16>());
  return y;
}

// x: [M, K] fp32 or bf16; y: [M, N] in x's dtype, fp32 sums, each segment through a panel driver: bf16 x through the
// bf16 panel kernel's (quant_panel_linear.cpp: vdpbf16ps on the codes, or AMX tiles) where the build has its
// decoder, else this file's on x widened to fp32. amx: bf16 x on AMX tiles (amx_blocks.h; the build and CPU must have
// AMX-BF16) or vdpbf16ps (unset: vdpbf16ps, faster at one row); either way at every row count, one order per output.
at::Tensor gguf_vpanel_linear(const at::Tensor& x_in, const at::Tensor& data, const at::Tensor& table,
                              const c10::optional<at::Tensor>& bias, c10::optional<bool> amx) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "gguf_vpanel_linear: x float32 or bfloat16 [M, K]");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const bool tiles = amx.value_or(false);
  TORCH_CHECK(!tiles || (bf16 && gguf_amx_available()),
              "gguf_vpanel_linear: AMX tiles take bf16 x, on a build and CPU with AMX-BF16");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = pagoda_gguf::segment_rows(table);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gguf_vpanel_linear: bias fp32 [N]");
  const at::Tensor xb = bf16 ? x_in.contiguous() : at::Tensor();
  at::Tensor x;  // fp32 x, made once a segment needs it
  auto y = at::empty({M, N}, x_in.options());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  pagoda_gguf::for_segments(data, table, K, [&](const auto& src, int64_t row0, int64_t rows) {
    const float* b = bp ? bp + row0 : nullptr;
    using Src = std::decay_t<decltype(src)>;
    if (bf16 && gguf_panel_segment(xb.const_data_ptr<c10::BFloat16>(), M, K, Src::kType, src.w, rows, b,
                                   y.data_ptr<c10::BFloat16>() + row0, N, tiles))
      return;
    if (!x.defined()) x = x_in.to(at::kFloat).contiguous();
    if (!bf16) run(src, x.data_ptr<float>(), b, y.data_ptr<float>() + row0, M, rows, N);
    else run(src, x.data_ptr<float>(), b, y.data_ptr<c10::BFloat16>() + row0, M, rows, N);
  });
  return y;
}

// The weights of output rows `index` as gguf-py dequantizes them, fp32 [R, K] (w = q * s + o, the product exact):
// the embedding's lookups of a table shared with the head, and the reference.
at::Tensor gguf_vpanel_rows(const at::Tensor& data, const at::Tensor& table, const at::Tensor& index, int64_t K) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "gguf_vpanel_rows: index int64 [R]");
  const at::Tensor idx = index.contiguous();
  const int64_t R = idx.size(0);
  auto out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  std::vector<uint8_t> done(R, 0);
  pagoda_gguf::for_segments(data, table, K, [&](const auto& src, int64_t row0, int64_t rows) {
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      float lo[W], hi[W], s[P], o[P];
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = idx.data_ptr<int64_t>()[r] - row0;
        if (n < 0 || n >= rows) continue;
        done[r] = 1;
        const int64_t p = n / P, c = n % P;
        float* row = out.data_ptr<float>() + r * K;
        for (int64_t g = 0; g < src.G; ++g) {
          const auto grp = src.group(p, g);
          vstore(s, grp.s0);
          vstore(s + W, grp.s1);
          vstore(o, grp.o0);
          vstore(o + W, grp.o1);
          for (int64_t k = g * src.gs; k < (g + 1) * src.gs; ++k) {
            vf a, b;
            src.load(p, k, a, b);
            vstore(lo, a);
            vstore(hi, b);
            row[k] = __builtin_fmaf(c < W ? lo[c] : hi[c - W], s[c], o[c]);
          }
        }
      }
    });
  });
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(done[r], "gguf_vpanel_rows: row ", idx.data_ptr<int64_t>()[r],
                                              " is out of range");
  return out;
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("gguf_vpanel_linear(Tensor x, Tensor data, Tensor table, Tensor? bias, bool? amx=None) -> Tensor");
  m.def("gguf_amx_available() -> bool", &pagoda_cpu::gguf_amx_available);
  m.def("gguf_vpanel_rows(Tensor data, Tensor table, Tensor index, int K) -> Tensor");
  m.def("quant_vpanel_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, int group_size, "
        "int kind=0) -> Tensor");
  m.def("quant_vpanels_supported(int K, int group_size) -> bool", &quant_vpanels_supported);  // no tensors
  m.def("vpanel_width() -> int", &vpanel_width);
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("quant_vpanel_linear", &pagoda_cpu::quant_vpanel_linear);
  m.impl("gguf_vpanel_linear", &pagoda_cpu::gguf_vpanel_linear);
  m.impl("gguf_vpanel_rows", &pagoda_cpu::gguf_vpanel_rows);
}
