// INT4 weights times INT8 activations over an 8-row interleaved layout (fmt kInt4x8; K % 64 == 0), written once
// for x86 (AVX512-VNNI, AVX2) and Arm (NEON with the dot-product extension); torch-free, so tests/simd/simd_check.cpp
// runs it against its definition on every target, Arm under qemu.
// x is quantized per row and 32 columns to int8 with its own scale a (symmetric, round to nearest), as
// llama.cpp's Q8 blocks are, so each 32 columns' dot product is an integer: y += s * a * sum(code * xq).
// Layout (int4x8): for each block of 8 weight rows and 64-column chunk, 8 vectors of 32 bytes; vector t
// holds bytes [4t, 4t + 4) of the chunk's 32 bytes from each of the 8 rows (row j in 32-bit lane j).
// Every lane is one output row, so the group's 8 scales, offsets and the outputs are single vector loads
// and stores: no per-row horizontal sums or scalar scale work, which dominate a row layout at small groups.
// xq holds each 64-column chunk as [even | odd] columns: the low nibbles of bytes [4t, 4t + 4) are even
// columns 8t..8t+6, the high nibbles the odd ones.
// The integer sums are exact whatever the instructions (I8Dot below: vpdpbusd, vpmaddubsw pairs, sdot), and
// each 32-column half's float step (convert, times s * a, one fused multiply-add into one chain per output in
// k order) is the same at every row count (batch invariance).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace pagoda_i8 {

typedef float v8f __attribute__((vector_size(32)));    // 8 output rows
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One 32-column half's integer sums per row (8 lanes). Codes: 8 rows x 4 bytes (8 codes each) of one step t,
// split into nibbles once and shared by every activation row; X: that row's 4 even and 4 odd activation bytes.
#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_INT4X8_I8 1
struct Codes {
  __m256i lo, hi;
  explicit Codes(const uint8_t* p) {
    const __m256i nib = _mm256_set1_epi8(0x0F), v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_and_si256(v, nib);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  }
};
struct X {
  __m256i lo, hi;
  X(int32_t even, int32_t odd) : lo(_mm256_set1_epi32(even)), hi(_mm256_set1_epi32(odd)) {}
};
inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// vpdpbusd: 4 unsigned codes times 4 signed activation bytes into each int32 lane.
struct I8Dot {
  __m256i i = _mm256_setzero_si256();
  inline void add(const Codes& c, const X& x) {
    i = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(i, c.lo, x.lo), c.hi, x.hi);
  }
  inline v8i sums() const { return (v8i)i; }
};
constexpr int64_t kRows = 8;  // activation rows per pass: 8 int32 chains + 8 fp32 sums in 32 registers
#else
// AVX2: vpmaddubsw multiplies unsigned codes by signed activations into 16-bit pairs (|pair| <= 2 * 15 * 127), kept
// in int16 over the half's 4 steps (|sum| <= 16 * 15 * 127 = 30480 < 2^15: exact) and widened once by vpmaddwd:
// 2 instructions per 32 products where vpdpbusd takes 1 per 32, against fp32's 4 FMAs.
struct I8Dot {
  __m256i i = _mm256_setzero_si256();
  inline void add(const Codes& c, const X& x) {
    i = _mm256_add_epi16(i, _mm256_add_epi16(_mm256_maddubs_epi16(c.lo, x.lo), _mm256_maddubs_epi16(c.hi, x.hi)));
  }
  inline v8i sums() const { return (v8i)_mm256_madd_epi16(i, _mm256_set1_epi16(1)); }
};
constexpr int64_t kRows = 6;  // 6 int16 chains + 6 fp32 sums + codes and broadcasts in AVX2's 16 registers
#endif
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define PAGODA_INT4X8_I8 1
// sdot: 4 signed bytes times 4 signed bytes into each int32 lane (codes 0..15 are signed bytes too); rows 0-3 in one
// q register, 4-7 in the other.
struct Codes {
  int8x16_t lo[2], hi[2];
  explicit Codes(const uint8_t* p) {
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t v = vld1q_u8(p + 16 * h);
      lo[h] = vreinterpretq_s8_u8(vandq_u8(v, nib));
      hi[h] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
  }
};
struct X {
  int8x16_t lo, hi;
  X(int32_t even, int32_t odd)
      : lo(vreinterpretq_s8_s32(vdupq_n_s32(even))), hi(vreinterpretq_s8_s32(vdupq_n_s32(odd))) {}
};
inline v8f fma8(v8f a, v8f b, v8f c) {
  float32x4_t r[2];
  for (int h = 0; h < 2; ++h) {
    float32x4_t ah, bh, ch;
    std::memcpy(&ah, reinterpret_cast<const float*>(&a) + 4 * h, 16);
    std::memcpy(&bh, reinterpret_cast<const float*>(&b) + 4 * h, 16);
    std::memcpy(&ch, reinterpret_cast<const float*>(&c) + 4 * h, 16);
    r[h] = vfmaq_f32(ch, ah, bh);  // c + a * b, rounded once
  }
  v8f out;
  std::memcpy(&out, r, sizeof(out));
  return out;
}
struct I8Dot {
  int32x4_t i[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
  inline void add(const Codes& c, const X& x) {
    for (int h = 0; h < 2; ++h) i[h] = vdotq_s32(vdotq_s32(i[h], c.lo[h], x.lo), c.hi[h], x.hi);
  }
  inline v8i sums() const {
    v8i out;
    std::memcpy(&out, i, sizeof(out));
    return out;
  }
};
constexpr int64_t kRows = 6;  // 12 int32 + 12 fp32 q registers of NEON's 32, beside the codes and broadcasts
#endif

// 8 sums as O: fp32 as they are; a 16-bit O as bf16 bits rounded as c10 rounds (simd.h's vround_bf16_bits, a lane
// at a time: 8 outputs per block and row, off the k loop).
template <typename O>
inline void store8(O* p, v8f v) {
  if constexpr (sizeof(O) == 4) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    static_assert(sizeof(O) == 2, "fp32 or bf16 outputs");
    for (int j = 0; j < 8; ++j) {
      const auto h = static_cast<uint16_t>(pagoda_simd::vround_bf16_bits(pagoda_simd::vsplat(v[j]))[0]);
      std::memcpy(p + j, &h, sizeof(h));
    }
  }
}

#if defined(PAGODA_INT4X8_I8)
// y[m, 8b + j] for activation rows [0, M) and blocks [b0, b1), R blocks at a time. w: [N / 8, 4K] codes; scales,
// offsets (or null): [N / 8, G, 8]; xq: [M, K] (each 64 columns [even | odd]), xa: [M, K / 32], xs: [M, G].
template <int M, int R, typename O>
void blocks_int4x8_i8(const uint8_t* w, const float* scales, const float* offsets, const float* bias,
                      const int8_t* xq, const float* xa, const float* xs, O* y, int64_t ldy, int64_t K, int64_t G,
                      int64_t gs, int64_t b0, int64_t b1) {
  const int64_t block_bytes = 4 * K;  // 8 rows x K / 2
  const int64_t ahead = std::max<int64_t>(2, (8192 + block_bytes - 1) / block_bytes);
  int64_t b = b0;
  for (; b + R <= b1; b += R) {
    v8f acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = v8f{};
    for (int64_t k = 0; k < K; k += 64) {
      // The blocks ~8 KiB ahead into L2, all four lines of this chunk: with the hardware prefetcher
      // alone this loop waits on memory. L2, not L1: the lines are read a chunk later, not at once.
      for (int r = 0; r < R; ++r)
        for (int line = 0; line < 4; ++line)
          __builtin_prefetch(w + (b + r + ahead) * block_bytes + k * 4 + 64 * line, 0, 2);
      for (int half = 0; half < 2; ++half) {  // columns [k, k + 32), then [k + 32, k + 64): one chain each
        I8Dot dot[R][M];
        for (int t = 4 * half; t < 4 * half + 4; ++t) {
          for (int r = 0; r < R; ++r) {
            const Codes c(w + (b + r) * block_bytes + k * 4 + 32 * t);
            for (int m = 0; m < M; ++m) {
              int32_t even, odd;
              std::memcpy(&even, xq + m * K + k + 4 * t, 4);
              std::memcpy(&odd, xq + m * K + k + 32 + 4 * t, 4);
              dot[r][m].add(c, X(even, odd));
            }
          }
        }
        const int64_t g = (k + 32 * half) / gs;  // the weight group of this half (the two differ at gs = 32)
        for (int r = 0; r < R; ++r) {
          const v8f s = load8(scales + ((b + r) * G + g) * 8);
          for (int m = 0; m < M; ++m) {
            const float a = xa[m * (K / 32) + k / 32 + half];  // the half's activation scale
            acc[r][m] = fma8(__builtin_convertvector(dot[r][m].sums(), v8f), s * a, acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if (offsets)
        for (int64_t g = 0; g < G; ++g) {
          const v8f o = load8(offsets + ((b + r) * G + g) * 8);
          for (int m = 0; m < M; ++m) acc[r][m] = fma8(o, v8f{} + xs[m * G + g], acc[r][m]);
        }
      const v8f bv = bias ? load8(bias + (b + r) * 8) : v8f{};
      for (int m = 0; m < M; ++m) store8(y + m * ldy + (b + r) * 8, acc[r][m] + bv);
    }
  }
  if constexpr (R > 1) {
    if (b < b1) blocks_int4x8_i8<M, 1, O>(w, scales, offsets, bias, xq, xa, xs, y, ldy, K, G, gs, b, b1);
  }
}
#endif

}  // namespace pagoda_i8
