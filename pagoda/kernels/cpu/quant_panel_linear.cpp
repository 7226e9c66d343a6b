// y = x @ dequant(w)^T (+ bias) for INT4, INT8 and FP8 weights laid out in panels of 16 output columns,
// with bf16 activations (AVX512-BF16), at every row count. INT8 runs as two INT4 halves and FP8 as bf16 bit
// patterns (see Fp8Codes); the layout below is INT4's.
//
// Why panels: the row-major INT4 kernel (quant_linear.cpp) reduces every output across a vector and
// applies scales one row at a time, which at decode costs about as many instructions as the dot products;
// above 16 rows it dequantizes the whole weight per call for oneDNN. Here one 64-byte block holds 8 k
// by 16 columns, every output column owns one fp32 lane, and a group's 16 scales are one vector, so the
// block's codes are unpacked once and dotted against every row of the strip.
//
// Layout (kernels/quant_linear.py: PackedWeight.panels16): codes uint8 [N/16, K/8, 64]. Block b of panel p
// unpacks into four vdpbf16ps operands, operand o holding k = 8b + 2o + j of column c at word 2c + j: byte
// t's low nibble goes to operand (t % 16) / 8, its high nibble to operand 2 + (t % 16) / 8, both at word
// 8 (t / 16) + t % 8, which is where unpacklo/hi_epi8 against the byte 0x43 put it. The word 0x43qq is the
// bf16 number 128 + q exactly (the exponent of 128 leaves 7 mantissa bits), so each product is exact in
// fp32, and the 128 * sum(x) it adds per group comes off with the offset term at the end:
//   y[m, n] = sum_g s[n, g] * sum_{k in g} (128 + q) x  +  (o[n, g] - 128 s[n, g]) * sum_{k in g} x.
// scales and offsets (w = q * s + o) are fp32 [N/16, G, 16].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dispatch_rows.h"
#include "ops.h"
#include "panel_tile.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGODA_INT4_PANELS 1
#endif

namespace {

constexpr int64_t kPanel = 16, kBlockK = 8;
enum Kind : int64_t { kInt4 = 0, kInt8Halves = 1, kFp8 = 2 };  // quant_linear.py: int4p, int8p, fp8p
constexpr int kStrip = 8;  // x rows per tile
// Up to this many rows the codes go straight into dot products; above, each tile is dequantized once and
// runs the dense GEMM tile. Over SmolLM2's layers (cold) the direct path takes 0.65x the dequantizing one's
// time at 8 rows, 0.9x at 32, the same at 128 and 1.2x at 512.
constexpr int64_t kDirectMaxM = 128;
// INT8 halves do twice the dot products per weight: 1.6x faster than the row-major kernel at 16 rows, 0.9x
// at 64 (the LM head at 49152 x 576).
constexpr int64_t kDirectMaxMInt8 = 32;


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
// 128 bytes of e4m3fn codes, operand o = bytes [32o, 32o + 32) in word order. Sign-extended to 16 bits and
// shifted 4 up, an e4m3 byte's exponent and mantissa land in the low exponent and top mantissa bits of a
// bf16 and its sign (and copies of it) above: masked, that bf16 is the e4m3 value times 2^-120, which
// kScale gives back. e4m3 subnormals (|code| < 2^-6, under 3.5e-5 of a channel's largest weight) become bf16
// subnormals, which vdpbf16ps reads as zero; the dequantizing path (many rows) keeps them.
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

// Rows [0, R) of x against NP panels starting at w (panels pstride bytes apart). C: independent dot-product
// chains per (row, panel), so that few-row tiles are not bound by vdpbf16ps latency. The per-group
// partial sums stay in registers; the running sums go to `acc` (L1) once per group, which leaves the
// registers to R * NP * C chains (16 at 8 rows x 2 panels).
// G: groups of the codes; Gs: of the scales and offsets ([NP][Gs][16]), G / 2 for INT8 halves, whose code
// group g has scale group g % Gs (see quant_panel_linear).
template <typename Codes, int R, int NP, int C>
void tile(const uint16_t* __restrict x, int64_t K, const uint8_t* __restrict w, int64_t pstride,
          const float* __restrict scales, const float* __restrict offsets, int64_t G, int64_t Gs, int64_t gs,
          const float* __restrict xs, const float* __restrict bias, c10::BFloat16* __restrict y, int64_t ldy,
          const uint8_t* next) {
  alignas(64) float acc[R][NP][kPanel];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NP; ++v) _mm512_store_ps(acc[r][v], _mm512_setzero_ps());
  const int64_t blocks_per_group = gs / kBlockK;
  for (int64_t g = 0; g < G; ++g) {
    __m512 gacc[R][NP][C];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NP; ++v)
        for (int c = 0; c < C; ++c) gacc[r][v][c] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      // Unpack the block of every panel first, then each broadcast pair of x meets all NP panels at once
      // (x is not reloaded per panel, and nothing of x lives across the rows: no spills at 8 rows x 2).
      __m512bh op[NP][4];
      for (int v = 0; v < NP; ++v) {
        const uint8_t* block = w + v * pstride + b * Codes::kBytes;
        if (next)
          for (int64_t line = 0; line < Codes::kBytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + v * pstride + b * Codes::kBytes + line), _MM_HINT_T1);
        Codes::unpack(block, op[v]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(x + r * K + b * kBlockK);  // 4 pairs of x
        for (int o = 0; o < 4; ++o) {
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[o]);
          for (int v = 0; v < NP; ++v) gacc[r][v][o % C] = _mm512_dpbf16_ps(gacc[r][v][o % C], op[v][o], xb);
        }
      }
    }
    for (int v = 0; v < NP; ++v) {
      __m512 s = _mm512_loadu_ps(scales + (v * Gs + g % Gs) * kPanel);
      if constexpr (Codes::kScale != 1.f) s = _mm512_mul_ps(s, _mm512_set1_ps(Codes::kScale));
      for (int r = 0; r < R; ++r) {
        __m512 sum = gacc[r][v][0];
        for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, gacc[r][v][c]);
        _mm512_store_ps(acc[r][v], _mm512_fmadd_ps(sum, s, _mm512_load_ps(acc[r][v])));
      }
    }
  }
  const __m512 m128 = _mm512_set1_ps(-128.f);
  for (int v = 0; v < NP; ++v) {
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_load_ps(acc[r][v]);
    for (int64_t g = 0; g < G && (Codes::kCarries128 || offsets); ++g) {
      // The 128 each INT4 code carries; INT8 halves: the l half also the 128 of u = q + 128, and q's offsets.
      const bool l_half = G != Gs && g >= Gs, with_offset = offsets && (G == Gs || l_half);
      __m512 z = _mm512_setzero_ps();
      if constexpr (Codes::kCarries128) {
        const __m512 sv = _mm512_loadu_ps(scales + (v * Gs + g % Gs) * kPanel);
        z = _mm512_mul_ps(sv, l_half ? _mm512_add_ps(m128, m128) : m128);
      }
      if (with_offset) z = _mm512_add_ps(z, _mm512_loadu_ps(offsets + (v * Gs + g % Gs) * kPanel));
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[r * G + g]), a[r]);
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + v * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + v * kPanel),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a[r], bv)));
  }
}

// Panels [0, NP) of the codes as bf16 weights in packed_linear's layout [NP][K/2][16][2], w = q s + o
// rounded once to bf16 (as the dequantize-then-GEMM path rounds): operand o of block b is that layout's
// pair row 4b + o, so each converts in place of order. I8: INT8 halves (see quant_panel_linear), K the
// columns of the [h | l] codes; the output is the K/2 columns of the INT8 weight, w = (16 h + l - 128) s + o.
// scales, offsets: [NP][G][16], G the groups of the output's K.
template <typename Codes, int NP, bool I8>
void dequant_panels(const uint8_t* w, int64_t pstride, const float* scales, const float* offsets, int64_t G,
                    int64_t gs, c10::BFloat16* out, int64_t K) {
  // Lane i of the fp32 halves of an operand is column i / 2 (first 16 words) or 8 + i / 2 (last 16).
  const __m512i cols_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i cols_hi = _mm512_add_epi32(cols_lo, _mm512_set1_epi32(8));
  const int64_t blocks_per_group = gs / kBlockK, Kout = I8 ? K / 2 : K;
  auto as_f32 = [](__m512bh words, int half) {  // bf16 bits to fp32: the same bits, 16 places up
    const __m512i wi = (__m512i)words;
    const __m256i w16 = half ? _mm512_extracti64x4_epi64(wi, 1) : _mm512_castsi512_si256(wi);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
  };
  auto spread = [&](__m512 t, __m512 (&out2)[2]) {  // per column -> per lane of each fp32 half
    out2[0] = _mm512_permutexvar_ps(cols_lo, t);
    out2[1] = _mm512_permutexvar_ps(cols_hi, t);
  };
  for (int v = 0; v < NP; ++v) {
    auto* o = reinterpret_cast<__m512i*>(out + v * Kout * kPanel);
    for (int64_t g = 0; g < G; ++g) {
      // INT4 code words are 128 + c: w = (128 + c) s + (o - 128 s). I8: w = 16 (128 + h) s + (128 + l) s +
      // (o - 2304 s), as 128 * 16 + 128 + 128 (u = q + 128) = 2304. FP8: w = (bf16 word) 2^120 s + o.
      const __m512 sc = _mm512_loadu_ps(scales + (v * G + g) * kPanel);
      const __m512 off = offsets ? _mm512_loadu_ps(offsets + (v * G + g) * kPanel) : _mm512_setzero_ps();
      const float carried = !Codes::kCarries128 ? 0.f : I8 ? -2304.f : -128.f;
      __m512 s[2], sh[2], z[2];
      spread(_mm512_mul_ps(sc, _mm512_set1_ps(Codes::kScale)), s);
      spread(_mm512_mul_ps(sc, _mm512_set1_ps(16.f)), sh);
      spread(_mm512_fmadd_ps(sc, _mm512_set1_ps(carried), off), z);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        __m512bh op[4], opl[4];
        Codes::unpack(w + v * pstride + b * Codes::kBytes, op);
        if constexpr (I8) Codes::unpack(w + v * pstride + (b + Kout / kBlockK) * Codes::kBytes, opl);
        for (int q = 0; q < 4; ++q) {
          __m512 f[2];
          for (int h = 0; h < 2; ++h) {
            if constexpr (I8) f[h] = _mm512_fmadd_ps(as_f32(opl[q], h), s[h], _mm512_fmadd_ps(as_f32(op[q], h), sh[h], z[h]));
            else f[h] = _mm512_fmadd_ps(as_f32(op[q], h), s[h], z[h]);
          }
          _mm512_storeu_si512(o + 4 * b + q, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
        }
      }
    }
  }
}

// Every strip of rows over NP dequantized panels. Not inlined: inside the caller's lambda GCC kept the
// tile's accumulators in memory (a store after every dot product, 2.4x slower).
template <int NP>
__attribute__((noinline)) void dense_strips(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                                            const float* bias, c10::BFloat16* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kStrip)
    dispatch_m(std::min<int64_t>(kStrip, M - m0), [&](auto rc) {
      pagoda_panels::tile<c10::BFloat16, decltype(rc)::value, NP, float>(x + m0 * K, K, w, K, bias, y + m0 * N, N,
                                                                         nullptr);
    });
}

template <typename Codes, int NP>
void strips(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t pstride, const float* scales,
            const float* offsets, int64_t G, int64_t Gs, int64_t gs, const float* xs, const float* bias,
            c10::BFloat16* y, int64_t N, const uint8_t* next) {
  for (int64_t m0 = 0; m0 < M; m0 += kStrip)
    dispatch_m(std::min<int64_t>(kStrip, M - m0), [&](auto rc) {
      constexpr int R = decltype(rc)::value, C = R <= 2 ? 2 : 1;
      tile<Codes, R, NP, C>(x + m0 * K, K, w, pstride, scales, offsets, G, Gs, gs, xs + m0 * G, bias, y + m0 * N, N,
                     m0 == 0 ? next : nullptr);
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

// kind (Kind): kInt4; kInt8Halves, the weight INT8 as two INT4 halves (PackedWeight.int8_panels): codes
// u = q + 128 = 16 h + l become the codes of a [N, 2K] INT4 weight [h | l], whose first half multiplies 16 x
// (exact in bf16) and whose second half takes off the 128 of u (and carries q's offsets), so the product is
// x (q s + o) with the same exact products and fp32 sums, both halves sharing the INT8 weight's scales
// [N/16, K/gs, 16]; kFp8, e4m3 codes in 128-byte blocks (Fp8Codes), one scale per column (gs = K).
at::Tensor quant_panel_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t group_size, int64_t kind) {
  TORCH_CHECK(kind == kInt4 || kind == kInt8Halves || kind == kFp8, "quant_panel_linear: unknown kind ", kind);
  const bool halves = kind == kInt8Halves;
  const int64_t block_bytes = kind == kFp8 ? 128 : 64;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "quant_panel_linear: x must be bf16 [M, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == block_bytes &&
                  codes.is_contiguous(),
              "quant_panel_linear: codes must be uint8 [N/16, K/8, ", block_bytes, "] (PackedWeight.panels16)");
  // Kx: the columns of x; K: of the codes (twice Kx for INT8 halves).
  const int64_t M = x_in.size(0), Kx = x_in.size(1), K = codes.size(1) * kBlockK, P = codes.size(0), N = P * kPanel;
  TORCH_CHECK(K == (halves ? 2 : 1) * Kx, "quant_panel_linear: x has ", Kx, " columns, the weight ",
              halves ? K / 2 : K);
  TORCH_CHECK(quant_panels_supported(Kx, group_size), "quant_panel_linear: unsupported K ", Kx, " / group size ",
              group_size, " (or no AVX512-BF16 in this build)");
  const bool dequantized = M > (halves ? kDirectMaxMInt8 : kDirectMaxM);
  const at::Tensor xo = x_in.contiguous();
  // The direct path's x: for INT8 halves [16 x | x], one column per column of the codes.
  const at::Tensor x = halves && !dequantized ? at::cat(std::vector<at::Tensor>{at::mul(xo, 16), xo}, 1) : xo;
  [[maybe_unused]] const int64_t G = K / group_size;  // groups of the codes (the kernel's; none without it)
  const int64_t Gs = Kx / group_size;                 // groups of the scales
  auto check_groups = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 3 && t.size(0) == P &&
                    t.size(1) == Gs && t.size(2) == kPanel,
                "quant_panel_linear: ", what, " must be fp32 [N/16, K/group_size, 16]");
  };
  check_groups(scales, "scales");
  if (offsets.has_value()) check_groups(*offsets, "offsets");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_panel_linear: bias must be fp32 [N]");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(PAGODA_INT4_PANELS)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* xb = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = codes.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* op = offsets.has_value() ? offsets->const_data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  auto* yp = y.mutable_data_ptr<c10::BFloat16>();
  const int64_t pstride = K / kBlockK * block_bytes;
  if (dequantized) {
    // Many rows: each tile of 3 panels is dequantized to bf16 once into a per-task buffer that stays in
    // L2, then runs the dense panel GEMM's 8 x 48 tile for every strip of rows. The unpacking is paid once
    // per weight, not once per strip, and the weight never goes to memory in bf16 (as it does for oneDNN).
    constexpr int NP = pagoda_panels::kTilePanels;
    at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t t0, int64_t t1) {
      // 64-byte aligned (torch's CPU allocator): the tile's vector loads must not straddle cache lines.
      const at::Tensor buf_t = at::empty({NP * Kx * kPanel}, x.options());
      c10::BFloat16* buf = buf_t.mutable_data_ptr<c10::BFloat16>();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = t * NP, n = std::min<int64_t>(NP, P - p);
        auto run = [&](auto npc) {
          constexpr int NPc = decltype(npc)::value;
          const uint8_t* wt = wp + p * pstride;
          const float *st = sp + p * Gs * kPanel, *ot = op ? op + p * Gs * kPanel : nullptr;
          if (kind == kFp8) dequant_panels<Fp8Codes, NPc, false>(wt, pstride, st, ot, Gs, group_size, buf, K);
          else if (halves) dequant_panels<Int4Codes, NPc, true>(wt, pstride, st, ot, Gs, group_size, buf, K);
          else dequant_panels<Int4Codes, NPc, false>(wt, pstride, st, ot, Gs, group_size, buf, K);
          dense_strips<NPc>(xo.const_data_ptr<c10::BFloat16>(), M, Kx, buf, bp ? bp + p * kPanel : nullptr,
                            yp + p * kPanel, N);
        };
        if (n == 3) run(std::integral_constant<int, 3>{});
        else if (n == 2) run(std::integral_constant<int, 2>{});
        else run(std::integral_constant<int, 1>{});
      }
    });
    return y;
  }
  // Group sums of x in fp32, for the offset term (and the 128 each INT4 code carries).
  std::vector<float> xs(M * G);
  if (kind != kFp8 || op)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const c10::BFloat16* r = xb + m * K + g * group_size;
        __m512 sum = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= group_size; k += 16) sum = _mm512_add_ps(sum, load_bf16x16(r + k));
        float total = _mm512_reduce_add_ps(sum);
        for (; k < group_size; ++k) total += static_cast<float>(r[k]);
        xs[m * G + g] = total;
      }
  // Few rows: the codes straight into dot products. At one row, four panels a tile (two chains each);
  // otherwise 8-row strips over two panels, revisited by every strip while they sit in L1. Threads split
  // the panels evenly, each walks its own tiles.
  const int np = M == 1 ? 4 : 2;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += np) {
      const int64_t n = std::min<int64_t>(np, p1 - p);
      // The next tile's codes into L2 while this one computes (at one row 1.3-1.5x faster than the hardware
      // prefetcher alone over a whole model's cold weights; into L1, or two tiles ahead, measured no better).
      const uint8_t* next = p + n + np <= p1 ? wp + (p + n) * pstride : nullptr;
      auto run = [&](auto npc) {
        constexpr int NP = decltype(npc)::value;
        auto go = [&](auto codes_tag) {
          using Codes = decltype(codes_tag);
          strips<Codes, NP>(xp, M, K, wp + p * pstride, pstride, sp + p * Gs * kPanel,
                            op ? op + p * Gs * kPanel : nullptr, G, Gs, group_size, xs.data(),
                            bp ? bp + p * kPanel : nullptr, yp + p * kPanel, N, next);
        };
        if (kind == kFp8) go(Fp8Codes{});
        else go(Int4Codes{});
      };
      switch (n) {
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
    }
  });
#endif
  return y;
}

}  // namespace

namespace pagoda_cpu {
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
