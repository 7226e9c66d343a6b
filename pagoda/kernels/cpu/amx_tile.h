// bf16 y = x @ w^T on AMX tiles, over packed_linear's bf16 panels ([N/16][K/2][16][2]: each panel's 32 k
// values of 16 columns are one 1 KiB B tile, pairs along K as TDPBF16PS takes them).
//
// Batch invariance: every output is one C tile element accumulated over the k blocks in order, by the same
// instruction whatever the row count; rows never mix (a row strip short of 16 is padded with zero rows, whose
// outputs are dropped). So a row's result is the same alone and in any batch.
//
// A thread owns a range of panel pairs and runs every row strip over them (the weights are read once per
// call); per k block it loads two A tiles (32 rows) and two B tiles (32 columns) into tmm4-7 and
// accumulates four C tiles (tmm0-3).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGODA_AMX 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_bf16.h"

namespace pagoda_amx {

constexpr int kRows = 16;    // rows of an A or C tile
constexpr int kBlockK = 32;  // bf16 values of K per tile (64 bytes a row)
constexpr int kPanel = 16;   // columns of a B or C tile

// Linux gives a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the answer is also whether the CPU and kernel have AMX at all.
inline bool available() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Makes cfg the thread's tile configuration. GCC does not count ldtilecfg as a read of its operand and may drop the
// stores that filled it (then the load faults), hence the barrier.
inline void load_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile is 16 rows of 64 bytes: C as fp32 [16][16], A as bf16 [16][32], B as bf16 pairs [16][16][2].
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kRows;
  }
  load_config(cfg);
}

// RB row strips of 16 x PB panels: C tiles 0..3 as (strip r, panel p) -> 2r + p.
template <int RB, int PB>
inline void block(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t panel_stride = K * kPanel;  // bf16 values of one panel
  for (int64_t k = 0; k < K; k += kBlockK) {
    _tile_loadd(4, x + k, K * 2);
    if constexpr (RB == 2) _tile_loadd(5, x + kRows * K + k, K * 2);
    _tile_loadd(6, w + k * kPanel, 64);
    if constexpr (PB == 2) _tile_loadd(7, w + panel_stride + k * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RB == 2 && PB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  // out: fp32 [RB * 16][PB * 16]
  const int64_t ld = PB * kPanel * 4;
  _tile_stored(0, out, ld);
  if constexpr (PB == 2) _tile_stored(1, out + kPanel, ld);
  if constexpr (RB == 2) _tile_stored(2, out + kRows * PB * kPanel, ld);
  if constexpr (RB == 2 && PB == 2) _tile_stored(3, out + kRows * PB * kPanel + kPanel, ld);
}

// Rows [0, rows) of an fp32 block [*, cols] (+ bias) into y as bf16 (cols: 16 or 32).
inline void store(const float* c, int64_t rows, int64_t cols, const c10::BFloat16* bias, c10::BFloat16* y,
                  int64_t ldy) {
  for (int64_t j = 0; j < cols; j += kPanel) {
    const __m512 b = bias ? load16(bias + j) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) store16(y + r * ldy + j, _mm512_add_ps(_mm512_load_ps(c + r * cols + j), b));
  }
}

// x [M, K] as whole strips of 16 rows for the tile loads: x itself, or a copy in `padded` with zero rows after M
// (whose outputs are never stored).
inline const c10::BFloat16* whole_strips(const c10::BFloat16* x, int64_t M, int64_t K,
                                         std::vector<c10::BFloat16>& padded) {
  if (M % kRows == 0) return x;
  padded.assign((M + kRows - 1) / kRows * kRows * K, c10::BFloat16(0.f));
  std::memcpy(padded.data(), x, M * K * sizeof(c10::BFloat16));
  return padded.data();
}

// x [M, K] bf16 (K a multiple of 32), w panels [N/16][K/2][16][2], y [M, N].
inline void linear(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, const c10::BFloat16* bias,
                   c10::BFloat16* y, int64_t N) {
  const int64_t strips = (M + kRows - 1) / kRows;
  std::vector<c10::BFloat16> padded;
  x = whole_strips(x, M, K, padded);
  const int64_t panels = N / kPanel, pairs = (panels + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    configure();
    alignas(64) float out[2 * kRows * 2 * kPanel];
    for (int64_t pp = p0; pp < p1; ++pp) {
      const int64_t p = 2 * pp, pb = std::min<int64_t>(2, panels - p);
      const c10::BFloat16* wp = w + p * K * kPanel;
      for (int64_t s = 0; s < strips; s += 2) {
        const int64_t rb = std::min<int64_t>(2, strips - s);
        const c10::BFloat16* xs = x + s * kRows * K;
        if (rb == 2 && pb == 2) block<2, 2>(xs, K, wp, out);
        else if (rb == 2) block<2, 1>(xs, K, wp, out);
        else if (pb == 2) block<1, 2>(xs, K, wp, out);
        else block<1, 1>(xs, K, wp, out);
        const int64_t rows = std::min<int64_t>(rb * kRows, M - s * kRows);
        store(out, rows, pb * kPanel, bias ? bias + p * kPanel : nullptr, y + s * kRows * N + p * kPanel, N);
      }
    }
    _tile_release();
  });
}

}  // namespace pagoda_amx
#endif
