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
// (strips of 16 rows, the last one padded with zero rows, whose outputs are dropped). The caller decides once per
// machine whether a source runs here, never per row count.
//
// Tiles: C 0-3 (strip s, panel v at 2s + v), A 4-5 (strip s), B 6-7 (panel v). A thread owns pairs of panels; per
// group it decodes a pair's B tiles once and runs every row strip of a chunk over them, two strips at a time.
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

constexpr int kChunkStrips = 8;  // row strips per pass over the weight: their running sums stay in L1

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
  _tile_loadconfig(&cfg);
}

// One group's dot products of SB strips (A from x, ldx bytes a row) with the NP B tiles already loaded, into
// c[s][row][NP * 16] (fp32, strip s at c + s * kRows * NP * 16).
template <int SB, int NP>
inline void group_dots(const c10::BFloat16* x, int64_t ldx, float* c) {
  constexpr int64_t ldc = NP * kPanel * 4, strip = kRows * NP * kPanel;
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

// y[m, c] (ldy apart) for the P panels of src, bias (fp32) indexed from its first column; x bf16 [M, K].
template <typename Src>
void run_blocks(const Src& src, const c10::BFloat16* x, int64_t M, int64_t K, int64_t P, const float* bias,
                c10::BFloat16* y, int64_t ldy) {
  constexpr int gs = static_cast<int>(Src::gs);
  static_assert(gs == 16 || gs == 32, "one B tile a group: groups of 16 or 32 k");
  constexpr bool kCarried = Src::kCarry != 0.f;
  const int64_t G = src.G;
  const bool xsum_terms = kCarried || src.has_offsets();
  const std::vector<float> xs = xsum_terms ? pagoda_simd::group_sums(x, M, K, gs) : std::vector<float>();
  const int rows = static_cast<int>(std::min<int64_t>(M, kRows));
  const int64_t strips = (M + kRows - 1) / kRows;
  std::vector<c10::BFloat16> padded;
  if (M > kRows && M % kRows) {  // whole strips for the tile loads; the zero rows' outputs are never stored
    padded.assign(strips * kRows * K, c10::BFloat16(0.f));
    std::memcpy(padded.data(), x, M * K * sizeof(c10::BFloat16));
    x = padded.data();
  }
  const int64_t pairs = (P + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    configure_groups<gs>(rows);
    alignas(64) uint8_t b[2][gs / 2 * 64];                          // a pair's B tiles of one group
    alignas(64) float c[2 * kRows * 2 * kPanel];                    // two strips' dot products of one group
    alignas(64) float acc[kChunkStrips * kRows][2][kPanel];         // running sums of a chunk's rows
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q, np = std::min<int64_t>(2, P - p);
      const int64_t next = q + 1 < q1 ? p + 2 : -1;  // the next pair's codes into L2 during the first chunk
      for (int64_t s0 = 0; s0 < strips; s0 += kChunkStrips) {
        const int64_t s1 = std::min(strips, s0 + kChunkStrips);
        const int64_t r0 = s0 * kRows, r1 = std::min(M, s1 * kRows);
        for (int64_t r = r0; r < r1; ++r)
          for (int v = 0; v < 2; ++v) _mm512_store_ps(acc[r - r0][v], _mm512_setzero_ps());
        for (int64_t g = 0; g < G; ++g) {
          for (int v = 0; v < np; ++v) {
            for (int i = 0; i < gs / 8; ++i) {
              if (next >= 0 && s0 == 0 && next + v < P) src.prefetch(next + v, g, i);
              __m512bh op[4];
              src.operands(p + v, g, i, op);
              for (int o = 0; o < 4; ++o) _mm512_store_si512(b[v] + (4 * i + o) * 64, (__m512i)op[o]);
            }
          }
          _tile_loadd(6, b[0], 64);
          if (np == 2) _tile_loadd(7, b[1], 64);
          decltype(src.group(p, g, kCarried)) t[2];
          for (int v = 0; v < np; ++v) t[v] = src.group(p + v, g, kCarried);
          for (int64_t s = s0; s < s1; s += 2) {
            const int64_t sb = std::min<int64_t>(2, s1 - s);
            const c10::BFloat16* xa = x + s * kRows * K + g * gs;
            if (np == 2) with_strips(sb, [&](auto n) { group_dots<decltype(n)::value, 2>(xa, 2 * K, c); });
            else with_strips(sb, [&](auto n) { group_dots<decltype(n)::value, 1>(xa, 2 * K, c); });
            const int64_t ra = s * kRows, rb = std::min(M, (s + sb) * kRows);
            for (int64_t r = ra; r < rb; ++r) {
              const float* cr = c + ((r - ra) / kRows * kRows * np + (r - ra) % kRows * np) * kPanel;
              const __m512 xsum = xsum_terms ? _mm512_set1_ps(xs[r * G + g]) : _mm512_setzero_ps();
              for (int v = 0; v < np; ++v) {
                __m512 a = _mm512_load_ps(acc[r - r0][v]);
                a = _mm512_fmadd_ps(_mm512_load_ps(cr + v * kPanel), t[v].scales, a);
                if (xsum_terms) a = _mm512_fmadd_ps(t[v].xsum, xsum, a);
                _mm512_store_ps(acc[r - r0][v], a);
              }
            }
          }
        }
        for (int v = 0; v < np; ++v) {
          const __m512 bv = bias ? _mm512_loadu_ps(bias + (p + v) * kPanel) : _mm512_setzero_ps();
          for (int64_t r = r0; r < r1; ++r) {
            const __m512 out = _mm512_add_ps(_mm512_load_ps(acc[r - r0][v]), bv);
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
