// bf16 y = x @ dequant(w)^T (+ bias) on AMX tiles, for a source of vdpbf16ps operands with groups of 16 or 32 k
// (quant_panel_linear.cpp's driver interface; gguf_blocks.h's DotBlocks): the AMX counterpart of that file's `run`.
//
// Why the operands fit: per 16-column panel and block of 8 k a source gives four operands, operand o holding
// k = 2o + j of column c at word 2c + j. Stored one after another, the operands of a group's gs / 8 blocks are the
// rows of one AMX B tile (gs / 2 pairs of k x 16 columns, pairs along K as TDPBF16PS takes them), so a group's codes
// are decoded into an L1 buffer, tile-loaded, and multiplied with an A tile of x's rows over the group's k.
//
// One order (batch invariance): a C tile holds one group's dot products only (zeroed, one TDPBF16PS, stored); each
// output's running sum then takes, group by group, that dot product times the group's scales, then the group's
// coefficient times its sum of x; after the last group the bias, and one rounding to bf16. A C element depends only
// on its row of A and column of B, so a row's bits are the same alone (A and C tiles of M rows) and in any batch
// (strips of 16 rows, the last one padded with zero rows, whose outputs are dropped). TDPBF16PS does not add a
// group's products as a vdpbf16ps chain does, so the two drivers' bits differ: a caller picks one for a weight and
// keeps it at every row count (gguf_vpanel_linear's `amx`).
//
// The cost at one row: each group's codes go to memory and back into a tile, and its dot products out of one, which
// costs more than the vdpbf16ps it replaces; from a few rows up the tiles win by several times, so bf16 GGUF weights
// take them wherever the CPU has AMX (quant_linear.py: kernel_layout), as dense bf16 weights do.
//
// Tiles: C 0-3 (strip s, panel v at 2s + v), A 4-5 (strip s), B 6-7 (panel v). A thread owns pairs of panels and
// walks their groups in blocks: per group it loads the pair's B tiles (decoded kAhead groups earlier) and runs the
// chunk's row strips over them, two at a time; per block the epilogue keeps a strip's running sums in registers.
#pragma once

#include "amx_tile.h"

#if defined(PAGODA_AMX) && defined(__AVX512BF16__)
#define PAGODA_AMX_BLOCKS 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_decode.h"

namespace pagoda_amx {

constexpr int kChunkStrips = 2;  // row strips per pass over the weight
constexpr int kBlockGroups = 4;  // groups whose dot products wait in L1 for one pass of the epilogue
constexpr int kAhead = 2;        // groups decoded ahead of the tiles
constexpr int kRing = 4;         // B buffers: more than kAhead

// C and A tiles of `rows` rows (every strip's, or M's where M < 16), A and B over a group of gs k.
template <int Gs>
inline void configure_groups(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {  // C: fp32 [rows][16]
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t = 4; t < 6; ++t) {  // A: bf16 [rows][gs]
    cfg.colsb[t] = 2 * Gs;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t = 6; t < 8; ++t) {  // B: gs / 2 pairs of k x 16 columns
    cfg.colsb[t] = 64;
    cfg.rows[t] = Gs / 2;
  }
  load_config(cfg);
}

// One group's dot products of SB strips (A from x, ldx bytes a row) with the NP B tiles already loaded, into
// c[row][32] (fp32; panel v at column 16 v, strip s from row 16 s).
template <int SB, int NP>
inline void group_dots(const c10::BFloat16* x, int64_t ldx, float* c) {
  constexpr int64_t ldc = 2 * kPanel * 4, strip = kRows * 2 * kPanel;
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (SB == 2) _tile_zero(2);
  if constexpr (SB == 2 && NP == 2) _tile_zero(3);
  _tile_loadd(4, x, ldx);
  if constexpr (SB == 2) _tile_loadd(5, x + kRows * ldx / 2, ldx);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NP == 2) _tile_dpbf16ps(1, 4, 7);
  if constexpr (SB == 2) _tile_dpbf16ps(2, 5, 6);
  if constexpr (SB == 2 && NP == 2) _tile_dpbf16ps(3, 5, 7);
  _tile_stored(0, c, ldc);
  if constexpr (NP == 2) _tile_stored(1, c + kPanel, ldc);
  if constexpr (SB == 2) _tile_stored(2, c + strip, ldc);
  if constexpr (SB == 2 && NP == 2) _tile_stored(3, c + strip + kPanel, ldc);
}

template <typename Fn>
inline void with_strips(int64_t sb, Fn&& fn) {
  if (sb == 2) fn(std::integral_constant<int, 2>{});
  else fn(std::integral_constant<int, 1>{});
}

// Calls fn with the first of 1, 2, 4, 8, 16 that is at least n, as a compile-time constant.
template <typename Fn>
inline void with_rows(int64_t n, Fn&& fn) {
  if (n <= 1) fn(std::integral_constant<int, 1>{});
  else if (n <= 2) fn(std::integral_constant<int, 2>{});
  else if (n <= 4) fn(std::integral_constant<int, 4>{});
  else if (n <= 8) fn(std::integral_constant<int, 8>{});
  else fn(std::integral_constant<int, kRows>{});
}

// The epilogue of nb groups for R rows of one panel, their running sums in registers: per group, in order, the dot
// product (c: row r of group j at c + j * ldg + r * 2 * kPanel) times the scales, then the coefficient times the
// row's sum of x (xs: row r, group j at xs[r * G + j]).
template <int R, bool Xsum, typename Terms>
inline void scale_rows(float* acc, const float* c, int64_t ldg, const Terms* t, const float* xs, int64_t G, int nb) {
  constexpr int ld = 2 * kPanel;
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_load_ps(acc + r * ld);
  for (int j = 0; j < nb; ++j) {
    const __m512 s = t[j].scales, o = t[j].xsum;
    for (int r = 0; r < R; ++r) {
      a[r] = _mm512_fmadd_ps(_mm512_load_ps(c + j * ldg + r * ld), s, a[r]);
      if constexpr (Xsum) a[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[r * G + j]), a[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_store_ps(acc + r * ld, a[r]);
}

// y[m, c] (ldy apart) for the P panels of src, bias (fp32) indexed from its first column; x bf16 [M, K].
template <typename Src>
void run_blocks(const Src& src, const c10::BFloat16* x, int64_t M, int64_t K, int64_t P, const float* bias,
                c10::BFloat16* y, int64_t ldy) {
  constexpr int gs = static_cast<int>(Src::gs);
  static_assert(gs == 16 || gs == 32, "one B tile a group: groups of 16 or 32 k");
  constexpr bool kCarried = Src::kCarry != 0.f;
  constexpr bool kXsum = kCarried || Src::has_offsets();
  using Terms = decltype(src.group(0, 0, kCarried));
  if (M == 0) return;  // a tile of no rows is no configuration
  const int64_t G = src.G;
  const int rows = static_cast<int>(std::min<int64_t>(M, kRows));
  const int64_t strips = (M + kRows - 1) / kRows;
  std::vector<float> xs;
  if constexpr (kXsum) {
    xs = pagoda_simd::group_sums(x, M, K, gs);
    xs.resize(strips * kRows * G);  // the rows an epilogue computes past M (and drops) read zeros
  }
  std::vector<c10::BFloat16> padded;
  if (M > kRows) x = whole_strips(x, M, K, padded);  // under 16 rows the tiles have M rows
  const int64_t pairs = (P + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    configure_groups<gs>(rows);
    alignas(64) uint8_t b[kRing][2][gs / 2 * 64];                              // [g % kRing][panel]: B tiles
    alignas(64) float c[kBlockGroups][kChunkStrips * kRows][2 * kPanel];       // a block's dot products
    alignas(64) float acc[kChunkStrips * kRows][2 * kPanel];                   // running sums of a chunk's rows
    std::memset(c, 0, sizeof c);  // rows under 16 (M < 16) are never stored: the epilogue's extra rows read zeros
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q;
      const int np = static_cast<int>(std::min<int64_t>(2, P - p));
      const int64_t next = q + 1 < q1 ? p + 2 : -1;  // the next pair's codes into L2 during the first chunk
      for (int64_t s0 = 0; s0 < strips; s0 += kChunkStrips) {
        const int64_t s1 = std::min(strips, s0 + kChunkStrips);
        const int64_t r0 = s0 * kRows, r1 = std::min(M, s1 * kRows);
        // Group g + kAhead's codes are decoded while group g's tiles run: a tile load does not take data from the
        // store buffer, so its B tiles wait until their stores reach L1, which takes about a group's work. A block's
        // epilogue reads its dot products after the block's tiles, so it does not wait on the tile unit either.
        auto decode = [&](int64_t g) {
          for (int v = 0; v < np; ++v)
            for (int i = 0; i < gs / 8; ++i) {
              if (next >= 0 && s0 == 0 && next + v < P) src.prefetch(next + v, g, i);
              __m512bh op[4];
              src.operands(p + v, g, i, op);
              for (int o = 0; o < 4; ++o) _mm512_store_si512(b[g % kRing][v] + (4 * i + o) * 64, (__m512i)op[o]);
            }
        };
        for (int64_t r = 0; r < (s1 - s0) * kRows; ++r)
          for (int v = 0; v < 2; ++v) _mm512_store_ps(acc[r] + v * kPanel, _mm512_setzero_ps());
        for (int64_t g = 0; g < std::min<int64_t>(kAhead, G); ++g) decode(g);
        for (int64_t g0 = 0; g0 < G; g0 += kBlockGroups) {
          const int nb = static_cast<int>(std::min<int64_t>(kBlockGroups, G - g0));
          Terms t[2][kBlockGroups];
          for (int j = 0; j < nb; ++j) {
            const int64_t g = g0 + j;
            _tile_loadd(6, b[g % kRing][0], 64);
            if (np == 2) _tile_loadd(7, b[g % kRing][1], 64);
            for (int64_t s = s0; s < s1; s += 2) {
              const c10::BFloat16* xa = x + s * kRows * K + g * gs;
              float* cs = c[j][(s - s0) * kRows];
              with_strips(std::min<int64_t>(2, s1 - s), [&](auto n) {
                if (np == 2) group_dots<decltype(n)::value, 2>(xa, 2 * K, cs);
                else group_dots<decltype(n)::value, 1>(xa, 2 * K, cs);
              });
            }
            for (int v = 0; v < np; ++v) t[v][j] = src.group(p + v, g, kCarried);
            if (g + kAhead < G) decode(g + kAhead);
          }
          for (int64_t s = s0; s < s1; ++s)
            with_rows(std::min<int64_t>(kRows, M - s * kRows), [&](auto rc) {
              constexpr int R = decltype(rc)::value;
              const int64_t rs = (s - s0) * kRows;
              for (int v = 0; v < np; ++v)
                scale_rows<R, kXsum>(acc[rs] + v * kPanel, c[0][rs] + v * kPanel, kChunkStrips * kRows * 2 * kPanel,
                                     t[v], xs.data() + s * kRows * G + g0, G, nb);
            });
        }
        for (int v = 0; v < np; ++v) {
          const __m512 bv = bias ? _mm512_loadu_ps(bias + (p + v) * kPanel) : _mm512_setzero_ps();
          for (int64_t r = r0; r < r1; ++r) {
            const __m512 out = _mm512_add_ps(_mm512_load_ps(acc[r - r0] + v * kPanel), bv);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + (p + v) * kPanel),
                                (__m256i)_mm512_cvtneps_pbh(out));
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace pagoda_amx
#endif
