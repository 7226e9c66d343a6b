// The register tile of the panel-packed GEMM (packed_linear.cpp). Each output element is one fp32 chain over k in
// order, whatever the tile's rows and panels (batch invariance).
#pragma once

#include <cstdint>
#include <type_traits>

#include "vec_bf16.h"

namespace pagoda_panels {

constexpr int64_t kPanel = 16;  // output columns per packed panel (one fp32 vector of results)
constexpr int kTilePanels = 3;  // panels per register tile: 8 rows x 3 vectors = 24 accumulators
constexpr int kStrip = 8;       // x rows per register tile

#if defined(__AVX512F__)
// Rows [0, R) of x against NP consecutive panels starting at `w` (panels K*16 elements apart).
// B: the bias type (T, or fp32 for the quantized kernels' biases).
template <typename T, int R, int NP, typename B = T>
inline void tile(const T* __restrict x, int64_t ldx, const T* __restrict w, int64_t K, const B* __restrict bias,
                 T* __restrict y, int64_t ldy, const char* next) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t pstride = K * kPanel;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K; ++k) {
      if (next)
        for (int v = 0; v < kTilePanels; ++v) _mm_prefetch(next + (v * pstride + k * kPanel) * sizeof(T), _MM_HINT_T1);
      __m512 wv[NP];
      for (int v = 0; v < NP; ++v) wv[v] = _mm512_loadu_ps(w + v * pstride + k * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
        for (int v = 0; v < NP; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      if (next)
        for (int v = 0; v < kTilePanels; ++v)
          _mm_prefetch(next + (v * pstride + k2 * 2 * kPanel) * sizeof(T), _MM_HINT_T1);
      __m512bh wv[NP];
      for (int v = 0; v < NP; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * pstride + k2 * 2 * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * k2));
        for (int v = 0; v < NP; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
      }
    }
#endif
  }
  for (int v = 0; v < NP; ++v) {
    const __m512 b = bias ? load16(bias + v * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store16(y + r * ldy + v * kPanel, _mm512_add_ps(acc[r][v], b));
  }
}
#endif

}  // namespace pagoda_panels
