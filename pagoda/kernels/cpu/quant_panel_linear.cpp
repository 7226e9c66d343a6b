// y = x @ dequant(w)^T (+ bias) for INT4, INT8 and FP8 weights laid out in panels of 16 output columns,
// with bf16 or fp32 activations (built with AVX512-BF16), at every row count. INT8 codes become bf16 integers
// and FP8 codes bf16 bit patterns (see Int8Codes, Fp8Codes); the layout below is INT4's. The driver (tile, run)
// reads its weight through a source (CodePanels here; gguf_blocks.h's DotBlocks, GGUF blocks as stored, with bf16
// activations): per panel and block of 8 k four vdpbf16ps operands, per panel and group the scales and the
// coefficient of the group's sum of x. amx_blocks.h runs a GGUF source on AMX tiles instead, where a caller asks.
//
// Why panels: the row-major kernel (quant_linear.cpp) reduces every output across a vector and applies
// scales one row at a time, which costs about as many instructions as the dot products. Here one 64-byte
// block holds 8 k by 16 columns, every output column owns one fp32 lane, and a group's 16 scales are one
// vector, so the block's codes are unpacked once and dotted against every row of the strip.
//
// Layout (kernels/quant_linear.py: PackedWeight.panels16): codes uint8 [N/16, K/8, 64]. Block b of panel p
// unpacks into four vdpbf16ps operands, operand o holding k = 8b + 2o + j of column c at word 2c + j: byte
// t's low nibble goes to operand (t % 16) / 8, its high nibble to operand 2 + (t % 16) / 8, both at word
// 8 (t / 16) + t % 8, which is where unpacklo/hi_epi8 against the byte 0x43 put it. The word 0x43qq is the
// bf16 number 128 + q exactly (the exponent of 128 leaves 7 mantissa bits), so each product is exact in
// fp32, and the 128 * sum(x) it adds per group comes off with the offset term at the end:
//   y[m, n] = sum_g s[n, g] * sum_{k in g} (128 + q) x  +  (o[n, g] - 128 s[n, g]) * sum_{k in g} x.
// scales and offsets (w = q * s + o) are fp32 [N/16, G, 16].
//
// One order (batch invariance): a row's outputs must not depend on which other rows share the call, so every
// output element is summed the same way at every row count. Per group, one fp32 chain takes the group's dot
// products in k order (vdpbf16ps: a pair of products, then the lane's sum); the chain, times the group's
// scales, is added to the running sum, then the group's offset term (o - 128 s for INT4: the offsets and the
// carry) times its sum of x; after the last group the bias, and one rounding to bf16. The row count decides only
// how that work is tiled: rows per strip, panels per tile, which thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "amx_blocks.h"
#include "dispatch_rows.h"
#include "gguf_blocks.h"
#include "ops.h"
#include "quant_decode.h"
#include "vec_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGODA_INT4_PANELS 1
#endif

namespace {

constexpr int64_t kPanel = 16, kBlockK = 8;
enum Kind : int64_t { kInt4 = 0, kInt8 = 1, kFp8 = 2 };  // quant_linear.py: int4p, int8p, fp8p
constexpr int kStrip = 8;  // x rows per tile


#if defined(PAGODA_INT4_PANELS)
// How a block's bytes become four vdpbf16ps operands (8 k x 16 columns; operand o holds k = 2o + j of
// column c at word 2c + j), and what the scales must undo.
struct Int4Codes {  // 64 bytes, two codes a byte: the bf16 numbers 128 + q (layout above)
  static constexpr int64_t kBytes = 64;
  static constexpr bool kCarries128 = true;
  static constexpr float kScale = 1.f;
  static inline void unpack(const uint8_t* p, __m512bh (&op)[4]) {
    const __m512i nib = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
    const __m512i raw = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    op[0] = (__m512bh)_mm512_unpacklo_epi8(lo, c43);
    op[1] = (__m512bh)_mm512_unpackhi_epi8(lo, c43);
    op[2] = (__m512bh)_mm512_unpacklo_epi8(hi, c43);
    op[3] = (__m512bh)_mm512_unpackhi_epi8(hi, c43);
  }
};
// 128 bytes of int8 codes, operand o = bytes [32o, 32o + 32) in word order: each code converted to the bf16
// integer it is (|q| <= 128 needs 8 significant bits, which bf16 has), so each product is exact in fp32.
struct Int8Codes {
  static constexpr int64_t kBytes = 128;
  static constexpr bool kCarries128 = false;
  static constexpr float kScale = 1.f;
  static inline void unpack(const uint8_t* p, __m512bh (&op)[4]) {
    for (int o = 0; o < 4; ++o) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * o));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      op[o] = _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi
    }
  }
};
// 128 bytes of e4m3fn codes, operand o = bytes [32o, 32o + 32) in word order. Sign-extended to 16 bits and
// shifted 4 up, an e4m3 byte's exponent and mantissa land in the low exponent and top mantissa bits of a
// bf16 and its sign (and copies of it) above: masked, that bf16 is the e4m3 value times 2^-120, which
// kScale gives back. e4m3 subnormals (|code| < 2^-6, under 3.5e-5 of a channel's largest weight) become bf16
// subnormals, which vdpbf16ps reads as zero.
struct Fp8Codes {
  static constexpr int64_t kBytes = 128;
  static constexpr bool kCarries128 = false;
  static constexpr float kScale = 1.329227995784916e36f;  // 2^120
  static inline void unpack(const uint8_t* p, __m512bh (&op)[4]) {
    const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0x87F0));  // sign, exponent low 4, mantissa top 3
    for (int o = 0; o < 4; ++o) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * o)));
      op[o] = (__m512bh)_mm512_and_si512(_mm512_slli_epi16(w, 4), keep);
    }
  }
};
// The two epilogue terms of a group (gguf_blocks.h: DotBlocks returns them too).
using GroupTerms = pagoda_gguf::GroupTerms;

// A weight in panels16 (PackedWeight.panels16) as the tile reads it: every panel's blocks of Codes, pstride bytes
// apart, and fp32 scales and offsets [N/16, G, 16].
template <typename Codes>
struct CodePanels {
  // The value each code's bf16 carries on top of its own (the INT4 codes' 128), taken off in the epilogue.
  static constexpr float kCarry = Codes::kCarries128 ? 128.f : 0.f;
  const uint8_t* w;
  int64_t pstride;
  const float* scales;
  const float* offsets;  // or null
  int64_t G, gs;

  bool has_offsets() const { return offsets != nullptr; }
  // Block i of group g (k = g gs + 8i) of panel v.
  const uint8_t* at(int64_t v, int64_t g, int i) const {
    return w + v * pstride + (g * gs / kBlockK + i) * Codes::kBytes;
  }
  void operands(int64_t v, int64_t g, int i, __m512bh (&op)[4]) const { Codes::unpack(at(v, g, i), op); }
  void prefetch(int64_t v, int64_t g, int i) const {
    for (int64_t line = 0; line < Codes::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(at(v, g, i) + line), _MM_HINT_T1);
  }
  // Group g of panel v: its scales (what multiplies the codes' dot product) and what multiplies its sum of x (the
  // offsets, less the carry times the scales where the codes carried it).
  GroupTerms group(int64_t v, int64_t g, bool carried) const {
    const __m512 s = _mm512_loadu_ps(scales + (v * G + g) * kPanel);
    const __m512 o = offsets ? _mm512_loadu_ps(offsets + (v * G + g) * kPanel) : _mm512_setzero_ps();
    if constexpr (Codes::kScale != 1.f) return {_mm512_mul_ps(s, _mm512_set1_ps(Codes::kScale)), o};
    else return {s, carried ? _mm512_fmadd_ps(s, _mm512_set1_ps(-kCarry), o) : o};
  }
};

// Rows [0, R) of x (T: bf16 or fp32) against panels [v0, v0 + NP) of src, in the one order above; y and bias are
// indexed by panel from the source's first column. bf16 x: one vdpbf16ps per pair of k; fp32 x: each operand's
// words split into the fp32 values of its two k (the same numbers: a bf16 is the top half of an fp32) for one FMA
// each, so every product is exact and every sum fp32, as in the row-major fp32 kernel. A group's chains (R * NP)
// live in registers; the running sums too where R * NP <= 12, else in `acc` (L1). Up to 2 rows (bf16) or 1 (fp32),
// each block's x is broadcast once and each panel's codes unpacked where they are used; more rows unpack every
// panel first and broadcast each value (pair) of x once for all of them. next: the first panel of the tile to
// prefetch, or -1.
template <typename Src, typename T, int R, int NP>
void tile(const Src& src, int64_t v0, const T* __restrict x, int64_t K, const float* __restrict xs,
          const float* __restrict bias, T* __restrict y, int64_t ldy, int64_t next) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  constexpr bool kSumsInRegs = R * NP <= 12;
  const int64_t G = src.G, gs = src.gs;
  __m512 sums[kSumsInRegs ? R : 1][kSumsInRegs ? NP : 1];
  alignas(64) float acc[kSumsInRegs ? 1 : R][kSumsInRegs ? 1 : NP][kPanel];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP; ++v) {
      if constexpr (kSumsInRegs) sums[r][v] = _mm512_setzero_ps();
      else _mm512_store_ps(acc[r][v], _mm512_setzero_ps());
    }
  auto operands = [&](int v, int64_t g, int i, __m512bh (&op)[4]) {  // block i of group g
    if (next >= 0) src.prefetch(next + v, g, i);
    src.operands(v0 + v, g, i, op);
  };
  // fp32 x: the carry comes off each value (exactly), not off the sum, where it would cancel most of the sum's bits.
  constexpr bool kCarried = Src::kCarry != 0.f && !kF32;
  // Operand o's k = 2o + j (j = 0: low words; 1: high words) as 16 fp32 column values.
  auto half = [](__m512bh op, int j) {
    const __m512i words = (__m512i)op;
    const __m512 w = _mm512_castsi512_ps(j ? _mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                           : _mm512_slli_epi32(words, 16));
    if constexpr (Src::kCarry != 0.f) return _mm512_sub_ps(w, _mm512_set1_ps(Src::kCarry));
    else return w;
  };
  auto pair = [&](int r, int64_t b, int o) {  // bf16 x[r, 8b + 2o : 8b + 2o + 2], broadcast
    return (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(x + r * K + b * kBlockK)[o]);
  };
  auto value = [&](int r, int64_t k) {  // fp32 x[r, k], broadcast
    return _mm512_set1_ps(reinterpret_cast<const float*>(x)[r * K + k]);
  };
  const int blocks_per_group = static_cast<int>(gs / kBlockK);
  for (int64_t g = 0; g < G; ++g) {
    __m512 gacc[R][NP];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NP; ++v) gacc[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < blocks_per_group; ++i) {
      const int64_t b = g * blocks_per_group + i;
      if constexpr (kF32 && R == 1) {
        __m512 xv[kBlockK];
        for (int k = 0; k < kBlockK; ++k) xv[k] = value(0, b * kBlockK + k);
        for (int v = 0; v < NP; ++v) {
          __m512bh op[4];
          operands(v, g, i, op);
          for (int o = 0; o < 4; ++o)
            for (int j = 0; j < 2; ++j) gacc[0][v] = _mm512_fmadd_ps(xv[2 * o + j], half(op[o], j), gacc[0][v]);
        }
      } else if constexpr (kF32) {
        __m512bh op[NP][4];
        for (int v = 0; v < NP; ++v) operands(v, g, i, op[v]);
        for (int o = 0; o < 4; ++o)
          for (int j = 0; j < 2; ++j) {
            __m512 wv[NP];
            for (int v = 0; v < NP; ++v) wv[v] = half(op[v][o], j);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m512 xb = value(r, b * kBlockK + 2 * o + j);
              for (int v = 0; v < NP; ++v) gacc[r][v] = _mm512_fmadd_ps(xb, wv[v], gacc[r][v]);
            }
          }
      } else if constexpr (R <= 2) {
        __m512bh xb[R][4];
        for (int r = 0; r < R; ++r)
          for (int o = 0; o < 4; ++o) xb[r][o] = pair(r, b, o);
#pragma GCC unroll 4
        for (int v = 0; v < NP; ++v) {
          __m512bh op[4];
          operands(v, g, i, op);
          for (int o = 0; o < 4; ++o)
            for (int r = 0; r < R; ++r) gacc[r][v] = _mm512_dpbf16_ps(gacc[r][v], op[o], xb[r][o]);
        }
      } else {
        __m512bh op[NP][4];
        for (int v = 0; v < NP; ++v) operands(v, g, i, op[v]);
        for (int o = 0; o < 4; ++o) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512bh xb = pair(r, b, o);
            for (int v = 0; v < NP; ++v) gacc[r][v] = _mm512_dpbf16_ps(gacc[r][v], op[v][o], xb);
          }
        }
      }
    }
    const bool xsum_terms = kCarried || src.has_offsets();
    for (int v = 0; v < NP; ++v) {
      const GroupTerms t = src.group(v0 + v, g, kCarried);
      for (int r = 0; r < R; ++r) {
        __m512 a;
        if constexpr (kSumsInRegs) a = sums[r][v];
        else a = _mm512_load_ps(acc[r][v]);
        a = _mm512_fmadd_ps(gacc[r][v], t.scales, a);
        if (xsum_terms) a = _mm512_fmadd_ps(t.xsum, _mm512_set1_ps(xs[r * G + g]), a);
        if constexpr (kSumsInRegs) sums[r][v] = a;
        else _mm512_store_ps(acc[r][v], a);
      }
    }
  }
  for (int v = 0; v < NP; ++v) {
    __m512 a[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (kSumsInRegs) a[r] = sums[r][v];
      else a[r] = _mm512_load_ps(acc[r][v]);
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + (v0 + v) * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 out = _mm512_add_ps(a[r], bv);
      T* yr = y + r * ldy + (v0 + v) * kPanel;
      if constexpr (kF32) _mm512_storeu_ps(yr, out);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

// Every strip of rows of x over NP panels. Not inlined: inside the caller's lambda GCC kept a tile's
// accumulators in memory (a store after every dot product).
template <typename Src, typename T, int NP>
__attribute__((noinline)) void strips(const Src& src, int64_t v0, const T* x, int64_t M, int64_t K, const float* xs,
                                      const float* bias, T* y, int64_t ldy, int64_t next) {
  const int64_t G = src.G;
  for (int64_t m0 = 0; m0 < M; m0 += kStrip)
    dispatch_m(std::min<int64_t>(kStrip, M - m0), [&](auto rc) {
      tile<Src, T, decltype(rc)::value, NP>(src, v0, x + m0 * K, K, xs + m0 * G, bias, y + m0 * ldy, ldy,
                                            m0 == 0 ? next : -1);
    });
}

// Calls fn with the Codes of `kind` (a tag value).
template <typename Fn>
void with_codes(int64_t kind, Fn&& fn) {
  if (kind == kInt4) fn(Int4Codes{});
  else if (kind == kInt8) fn(Int8Codes{});
  else fn(Fp8Codes{});
}

// Calls fn with n (1..Max) as a compile-time constant.
template <int Max, typename Fn>
void with_panels(int64_t n, Fn&& fn) {
  if constexpr (Max > 1) {
    if (n >= Max) return fn(std::integral_constant<int, Max>{});
    return with_panels<Max - 1>(n, fn);
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

// One tile of R rows (R = M: one or two rows) over NP panels; not inlined, as strips.
template <typename Src, typename T, int R, int NP>
__attribute__((noinline)) void few_rows(const Src& src, int64_t v0, const T* x, int64_t K, const float* xs,
                                        const float* bias, T* y, int64_t ldy, int64_t next) {
  tile<Src, T, R, NP>(src, v0, x, K, xs, bias, y, ldy, next);
}

// y[m, c] (ldy apart) for the P panels of src, bias indexed from its first column: the driver every source plugs into.
template <typename Src, typename T>
void run(const Src& src, const T* xp, int64_t M, int64_t K, int64_t P, const float* bp, T* yp, int64_t ldy) {
  const int64_t G = src.G;
  const bool carried = Src::kCarry != 0.f && !std::is_same_v<T, float>;  // see tile
  const std::vector<float> xs =
      carried || src.has_offsets() ? pagoda_simd::group_sums(xp, M, K, src.gs) : std::vector<float>(M * G);
  // The codes straight into dot products, at every row count. One row: four panels a tile (four chains); two
  // rows: four panels (eight chains); more: strips of 8 rows over two panels, revisited by every strip while they
  // sit in L1. Threads split the panels evenly, each walks its own tiles. (No L2 buffer of unpacked codes for the
  // strips to share: the dot products and the per-group scaling bound the kernel, not the unpacking. No dense tile
  // over weights dequantized to bf16 at many rows either: it rounds the weights, so the sums would change with the
  // row count.)
  const int64_t np = M <= 2 ? 4 : 2;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += np) {
      const int64_t n = std::min<int64_t>(np, p1 - p);
      // The next tile's codes into L2 while this one computes (the hardware prefetcher alone leaves one row
      // waiting on a whole model's cold weights; one tile ahead into L2 is enough).
      const int64_t next = p + n + np <= p1 ? p + n : -1;
      if (M <= 2)
        with_panels<4>(n, [&](auto npc) {
          if (M == 1) few_rows<Src, T, 1, decltype(npc)::value>(src, p, xp, K, xs.data(), bp, yp, ldy, next);
          else few_rows<Src, T, 2, decltype(npc)::value>(src, p, xp, K, xs.data(), bp, yp, ldy, next);
        });
      else
        with_panels<2>(n, [&](auto npc) {
          strips<Src, T, decltype(npc)::value>(src, p, xp, M, K, xs.data(), bp, yp, ldy, next);
        });
    }
  });
}

template <typename T>
void run_codes(int64_t kind, const T* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t P, const float* sp,
               const float* op, const float* bp, int64_t gs, T* yp) {
  with_codes(kind, [&](auto codes_tag) {
    using Codes = decltype(codes_tag);
    const CodePanels<Codes> src{wp, K / kBlockK * Codes::kBytes, sp, op, K / gs, gs};
    run(src, xp, M, K, P, bp, yp, P * kPanel);
  });
}
#endif

bool quant_panels_supported(int64_t K, int64_t group_size) {
#if defined(PAGODA_INT4_PANELS)
  return group_size > 0 && group_size % kBlockK == 0 && K % group_size == 0;
#else
  (void)K;
  (void)group_size;
  return false;
#endif
}

// kind (Kind): kInt4, codes in 64-byte blocks (layout above); kInt8 and kFp8, codes in 128-byte blocks, operand
// o = bytes [32o, 32o + 32) (Int8Codes, Fp8Codes); FP8 has one scale per column (gs = K).
at::Tensor quant_panel_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t group_size, int64_t kind) {
  TORCH_CHECK(kind == kInt4 || kind == kInt8 || kind == kFp8, "quant_panel_linear: unknown kind ", kind);
  const int64_t block_bytes = kind == kInt4 ? 64 : 128;
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat),
              "quant_panel_linear: x must be bf16 or fp32 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == block_bytes &&
                  codes.is_contiguous(),
              "quant_panel_linear: codes must be uint8 [N/16, K/8, ", block_bytes, "] (PackedWeight.panels16)");
  const int64_t M = x_in.size(0), K = x_in.size(1), P = codes.size(0), N = P * kPanel;
  TORCH_CHECK(codes.size(1) * kBlockK == K, "quant_panel_linear: x has ", K, " columns, the weight ",
              codes.size(1) * kBlockK);
  TORCH_CHECK(quant_panels_supported(K, group_size), "quant_panel_linear: unsupported K ", K, " / group size ",
              group_size, " (or no AVX512-BF16 in this build)");
  const at::Tensor x = x_in.contiguous();
  [[maybe_unused]] const int64_t G = K / group_size;
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 && t.size(0) == P &&
                    t.size(1) == G && t.size(2) == kPanel,
                "quant_panel_linear: ", what, " must be fp32 [N/16, K/group_size, 16]");
  };
  check_groups(scales, "scales");
  if (offsets.has_value()) check_groups(*offsets, "offsets");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_panel_linear: bias must be fp32 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(PAGODA_INT4_PANELS)
  const auto* wp = codes.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* op = offsets.has_value() ? offsets->const_data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    run_codes<float>(kind, x.const_data_ptr<float>(), M, K, wp, P, sp, op, bp, group_size,
                     y.mutable_data_ptr<float>());
  else
    run_codes<c10::BFloat16>(kind, x.const_data_ptr<c10::BFloat16>(), M, K, wp, P, sp, op, bp, group_size,
                           y.mutable_data_ptr<c10::BFloat16>());
#endif
  return y;
}

}  // namespace

namespace pagoda_cpu {
bool gguf_amx_available() {
#if defined(PAGODA_INT4_PANELS) && defined(PAGODA_GGUF_BF16) && defined(PAGODA_AMX_BLOCKS)
  return pagoda_amx::available();
#else
  return false;
#endif
}

bool gguf_panel_segment(const c10::BFloat16* x, int64_t M, int64_t K, int64_t type, const uint8_t* data,
                        int64_t rows, const float* bias, c10::BFloat16* y, int64_t ldy, bool amx) {
  TORCH_CHECK(!amx || gguf_amx_available(), "gguf_panel_segment: this build or CPU has no AMX-BF16");
#if defined(PAGODA_INT4_PANELS) && defined(PAGODA_GGUF_BF16)
  return pagoda_gguf::dispatch_type(type, [&](auto c) {
    const pagoda_gguf::DotBlocks<decltype(c)::value> src(data, K);
#if defined(PAGODA_AMX_BLOCKS)
    if (amx) return pagoda_amx::run_blocks(src, x, M, K, rows / kPanel, bias, y, ldy);
#endif
    run(src, x, M, K, rows / kPanel, bias, y, ldy);
  });
#else
  (void)x, (void)M, (void)K, (void)type, (void)data, (void)rows, (void)bias, (void)y, (void)ldy, (void)amx;
  return false;
#endif
}

at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t group_size, int64_t kind) {
  return ::quant_panel_linear(x, codes, scales, offsets, bias, group_size, kind);
}
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("quant_panel_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, int group_size, "
        "int kind=0) -> Tensor");
  m.def("quant_panels_supported(int K, int group_size) -> bool", &quant_panels_supported);
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("quant_panel_linear", &quant_panel_linear); }
