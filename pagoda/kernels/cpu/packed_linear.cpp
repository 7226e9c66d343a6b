// y = x @ w^T (+ bias) in bf16 over a weight packed once at load into pairs along K (AVX512-BF16).
//
// Packed layout [N/16][K/2][16][2]: one 64-byte vector per (panel of 16 output columns, pair of input
// columns), the operand order of vdpbf16ps. A tile of 8 x-rows x 48 columns keeps 24 fp32 accumulators in
// registers; every step broadcasts one pair of x per row and loads three weight vectors, so there are no
// horizontal sums at all (the row-major streaming kernel reduces every output) and no per-call repacking.
// Each thread owns a range of column tiles and runs every row strip over a tile while it is in L2, so the
// weight is read from memory once per call: in batched decode (M of 8..64, K of 576..1536) that read and
// the dot products overlap, where oneDNN reaches ~50-70% of its own large-GEMM rate.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "dispatch_rows.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (one fp32 vector of results)
constexpr int kTilePanels = 3;  // panels per register tile: 8 rows x 3 vectors = 24 accumulators
constexpr int kStrip = 8;       // x rows per register tile

bool packed_linear_shape_ok(int64_t N, int64_t K) { return N % kPanel == 0 && K % 2 == 0 && K > 0; }

at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_pairs: w must be bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(packed_linear_shape_ok(N, K), "pack_bf16_pairs: needs N % 16 == 0 and an even K, got ", N, "x", K);
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({N / kPanel, K / 2, kPanel, 2}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.const_data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k2 = 0; k2 < K / 2; ++k2)
        for (int64_t j = 0; j < kPanel; ++j)
          for (int64_t t = 0; t < 2; ++t)
            dst[((p * (K / 2) + k2) * kPanel + j) * 2 + t] = src[(p * kPanel + j) * K + 2 * k2 + t];
  });
  return out;
}

#if defined(__AVX512BF16__)
// Rows [0, R) of x against NP consecutive panels starting at `w` (panel stride K*16 elements).
template <int R, int NP>
inline void tile(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K,
                 const uint16_t* __restrict bias, uint16_t* __restrict y, int64_t ldy) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pstride = K * kPanel;
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    __m512bh wv[NP];
    for (int v = 0; v < NP; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * pstride + k2 * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * k2));
      for (int v = 0; v < NP; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
    }
  }
  for (int v = 0; v < NP; ++v) {
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + v * kPanel))), 16));
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + v * kPanel),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b)));
  }
}

template <int NP>
void column_tile(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                 int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kStrip)
    dispatch_m(std::min<int64_t>(kStrip, M - m0), [&](auto rc) {
      tile<decltype(rc)::value, NP>(x + m0 * K, K, w, K, bias, y + m0 * N, N);
    });
}
#endif

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "packed_linear: x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed_linear: weight must come from pack_bf16_pairs");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kPanel;
  TORCH_CHECK(packed.size(1) * 2 == K, "packed_linear: x has ", K, " columns, the weight ", packed.size(1) * 2);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16, "packed_linear: bias");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.const_data_ptr());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->const_data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const int64_t panels = N / kPanel, tiles = (panels + kTilePanels - 1) / kTilePanels;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t * kTilePanels, np = std::min<int64_t>(kTilePanels, panels - p);
      const uint16_t* wt = wp + p * K * kPanel;
      const uint16_t* bt = bp ? bp + p * kPanel : nullptr;
      uint16_t* yt = yp + p * kPanel;
      if (np == 3) column_tile<3>(xp, M, K, wt, bt, yt, N);
      else if (np == 2) column_tile<2>(xp, M, K, wt, bt, yt, N);
      else column_tile<1>(xp, M, K, wt, bt, yt, N);
    }
  });
#else
  TORCH_CHECK(false, "packed_linear: built without AVX512-BF16");
#endif
  return y;
}

bool packed_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace pagoda_cpu {
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return ::packed_linear(x, packed, bias);
}
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("pack_bf16_pairs(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("packed_linear_supported() -> bool", &packed_linear_supported);
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("pack_bf16_pairs", &pack_bf16_pairs);
  m.impl("packed_linear", &packed_linear);
}
