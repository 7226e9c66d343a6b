// y = x @ w^T (+ bias) over a weight packed once at load into panels of 16 output columns
// (kernels/linear.py: panel_pack), for fp32 (AVX-512 FMA) and bf16 (AMX tiles where the CPU has them:
// amx_tile.h; else AVX512-BF16 dot products).
//
// Packed layout: fp32 [N/16][K][16]; bf16 [N/16][K/2][16][2], pairs along K as vdpbf16ps takes them.
// Either way one 64-byte vector holds a panel's 16 columns at one step of K. A tile of 8 x-rows x 48
// columns keeps 24 fp32 accumulators in registers; every step broadcasts one value (fp32) or pair (bf16)
// of x per row and loads three weight vectors, so there are no horizontal sums (the row-major streaming
// kernel reduces every output) and no per-call repacking (F.linear). Each thread owns a range of column
// tiles and runs every row strip over a tile while it is in L2, so the weight is read from memory once
// per call: in batched decode (M of 8..64, K of 576..1536) that read and the arithmetic overlap, where
// oneDNN stays well below its own large-GEMM rate.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx_tile.h"
#include "dispatch_rows.h"
#include "panel_tile.h"

namespace {

using pagoda_panels::kPanel;
using pagoda_panels::kStrip;
using pagoda_panels::kTilePanels;

#if defined(__AVX512F__)
using pagoda_panels::tile;

// `next`: the following column tile's weights (or null), prefetched into L2 during the first strip.
template <typename T, int NP>
void column_tile(const T* x, int64_t M, int64_t K, const T* w, const T* bias, T* y, int64_t N, const T* next) {
  for (int64_t m0 = 0; m0 < M; m0 += kStrip)
    dispatch_m(std::min<int64_t>(kStrip, M - m0), [&](auto rc) {
      tile<T, decltype(rc)::value, NP>(x + m0 * K, K, w, K, bias, y + m0 * N, N,
                                       m0 == 0 ? reinterpret_cast<const char*>(next) : nullptr);
    });
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = packed.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  const int64_t panels = N / kPanel, tiles = (panels + kTilePanels - 1) / kTilePanels;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t * kTilePanels, np = std::min<int64_t>(kTilePanels, panels - p);
      const T* wt = wp + p * K * kPanel;
      const T* bt = bp ? bp + p * kPanel : nullptr;
      T* yt = yp + p * kPanel;
      // Only whole tiles: a prefetch past the weight's end would be harmless but pointless.
      const T* next = t + 1 < t1 && p + 2 * kTilePanels <= panels ? wt + kTilePanels * K * kPanel : nullptr;
      if (np == 3) column_tile<T, 3>(xp, M, K, wt, bt, yt, N, next);
      else if (np == 2) column_tile<T, 2>(xp, M, K, wt, bt, yt, N, next);
      else column_tile<T, 1>(xp, M, K, wt, bt, yt, N, next);
    }
  });
}
#endif

// Mirrors pagoda.kernels.linear.panel_pack, which callers check first.
bool packed_linear_supported(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  (void)dtype;
  return false;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && packed.scalar_type() == dt,
              "packed_linear: x must be [M, K] contiguous, in the packed weight's dtype");
  TORCH_CHECK(packed_linear_supported(dt), "packed_linear: unsupported dtype ", dt);
  const bool bf16 = dt == at::kBFloat16;
  TORCH_CHECK(packed.dim() == (bf16 ? 4 : 3) && packed.size(2) == kPanel && (!bf16 || packed.size(3) == 2),
              "packed_linear: the weight must come from panel_pack");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kPanel;
  TORCH_CHECK(packed.size(1) * (bf16 ? 2 : 1) == K, "packed_linear: x has ", K, " columns, the weight ",
              packed.size(1) * (bf16 ? 2 : 1));
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == dt, "packed_linear: bias");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(PAGODA_AMX)
  // bf16 on AMX wherever the CPU has it, at every row count (one summation order per output: amx_tile.h).
  if (bf16 && K % pagoda_amx::kBlockK == 0 && pagoda_amx::available()) {
    pagoda_amx::linear(x.const_data_ptr<c10::BFloat16>(), M, K, packed.const_data_ptr<c10::BFloat16>(),
                       bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                       y.mutable_data_ptr<c10::BFloat16>(), N);
    return y;
  }
#endif
#if defined(__AVX512F__)
  if (bf16) run<c10::BFloat16>(x, packed, bias, y);
  else run<float>(x, packed, bias, y);
#endif
  return y;
}

}  // namespace

namespace pagoda_cpu {
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return ::packed_linear(x, packed, bias);
}
}  // namespace pagoda_cpu

bool amx_available() {
#if defined(PAGODA_AMX)
  return pagoda_amx::available();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "amx_linear: this build or CPU has no AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && x.size(1) % 32 == 0 &&
                  packed.size(1) * 2 == x.size(1),
              "amx_linear: x [M, K] bf16 with K a multiple of 32, and its weight from panel_pack");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kPanel;
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(PAGODA_AMX)
  pagoda_amx::linear(x.const_data_ptr<c10::BFloat16>(), M, K, packed.const_data_ptr<c10::BFloat16>(),
                     bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                     y.mutable_data_ptr<c10::BFloat16>(), N);
#else
  (void)bias;
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("amx_linear", &amx_linear);
}
