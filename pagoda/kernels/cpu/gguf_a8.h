// The integer dot products of GGUF blocks (gguf_blocks.h's panels) with int8 activations, the micro-kernels of
// gguf_a8_linear.cpp's driver: per weight group g of panel p and per activation row r, out[r][c] = the sum over the
// group's k of code(c, k) x[r][k], where code is the weight over its group's scale as Blocks::load gives it (q - bias,
// or the type's table value) and x the row's int8 values. Integer sums are exact, so every micro-kernel returns the
// same numbers; each may instead return the sum of (code + kCarry) x, the driver taking kCarry times the group's sum
// of x off. One per ISA, beside the reference every build has:
//   RefDots: Blocks::load's fp32 codes times x, FMA'd in fp32 (products of at most 128 x 128 over 32 k stay far below
//            2^24, so the fp32 sums are the integers), for any build (Arm, and types no faster kernel takes);
//   VnniDots (AVX-512 VNNI + the bf16 panel decoder's ISA): DotBlocks' decoded bytes, permuted so each 32-bit lane
//            holds 4 k of one column, as vpdpbusd's unsigned operand, one instruction per 4 k x 16 columns x row.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace pagoda_gguf {

// The int8 activations a type's dot product takes, as llama.cpp's vec_dot_type (ggml-cpu's type_traits_cpu): per 256
// values (Q8_K) for the K-quants and IQ4_XS, per 32 (Q8_0, and Q8_1's values) for the rest.
constexpr int act_block(int64_t type) {
  return type == kQ2_K || type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kIQ4_XS ? 256
                                                                                                                : 32;
}

// Up to this many activation rows share one decode of a group's codes.
constexpr int kA8Rows = 8;

template <int64_t T>
struct RefDots {
  static constexpr int kCarry = 0;
  static constexpr int64_t kType = T;
  Blocks<T> b;

  RefDots(const uint8_t* data, int64_t k) : b(data, k) {}
  template <int R>
  inline void dots(int64_t p, int64_t g, const int8_t* x, int64_t ldx, int32_t (*out)[P]) const {
    vf acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf{};
    for (int64_t i = 0; i < b.gs; ++i) {
      const int64_t k = g * b.gs + i;
      vf lo, hi;
      b.prefetch(p, k);
      b.load(p, k, lo, hi);
      for (int r = 0; r < R; ++r) {
        const vf xv = vf{} + static_cast<float>(x[r * ldx + i]);
        acc[r][0] = pagoda_simd::vfma(lo, xv, acc[r][0]);
        acc[r][1] = pagoda_simd::vfma(hi, xv, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const vi a = __builtin_convertvector(acc[r][0], vi), c = __builtin_convertvector(acc[r][1], vi);
      std::memcpy(out[r], &a, sizeof(a));
      std::memcpy(out[r] + W, &c, sizeof(c));
    }
  }
};

#if defined(PAGODA_GGUF_BF16) && defined(__AVX512VNNI__)
#define PAGODA_GGUF_VNNI 1

template <int64_t T>
struct VnniDots {
  using D = DotBlocks<T>;
  using Tr = Traits<T>;
  using Lay = Layout<T>;
  // Codes as unsigned bytes: a plain code q is (q - bias) + bias; a table's value v and Q8_0's signed byte as v + 128.
  static constexpr int kCarry = D::kWholeBytes || Lay::kLookup ? 128 : Tr::kBias;
  static constexpr int64_t kType = T;
  D d;

  VnniDots(const uint8_t* data, int64_t k) : d(data, k) {}

  // vpermb's selectors from codes4's byte 16 i + c to byte 4 c + i: column c's 4 k in its 32-bit lane.
  static constexpr std::array<uint8_t, 64> kQuads = [] {
    std::array<uint8_t, 64> t{};
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i) t[4 * c + i] = static_cast<uint8_t>(16 * i + c);
    return t;
  }();
  // A table's values plus 128, as the unsigned bytes vpermb picks by index.
  static constexpr std::array<uint8_t, 64> kTableBytes = [] {
    std::array<uint8_t, 64> t{};
    if constexpr (Lay::kLookup)
      for (int i = 0; i < 16; ++i) t[i] = static_cast<uint8_t>(Lay::kTable[i] + 128);
    return t;
  }();

  // 4 k (kk .. kk + 3 of super-block sb) of the half's 16 columns as vpdpbusd's unsigned operand.
  static inline __m512i quads(const uint8_t* sb, int64_t kk, int64_t h) {
    const __m512i sel = _mm512_loadu_si512(kQuads.data());
    if constexpr (D::kWholeBytes)
      return _mm512_xor_si512(_mm512_permutexvar_epi8(sel, D::bytes4(sb, kk, h)), _mm512_set1_epi8(-128));
    const __m512i z = _mm512_permutexvar_epi8(sel, D::codes4(sb, kk, h));
    if constexpr (Lay::kLookup) return _mm512_permutexvar_epi8(z, _mm512_loadu_si512(kTableBytes.data()));
    return z;
  }

  template <int R>
  inline void dots(int64_t p, int64_t g, const int8_t* x, int64_t ldx, int32_t (*out)[P]) const {
    const uint8_t* sb = d.block(2 * p, g * Tr::kGroup) + Blocks<T>::kMeta;
    const int64_t kk0 = g % D::kGroups * Tr::kGroup;
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int i = 0; i < Tr::kGroup; i += 4) {
      if (i % 8 == 0) {
        d.prefetch(2 * p, g, i / 8);
        d.prefetch(2 * p + 1, g, i / 8);
      }
      const __m512i u0 = quads(sb, kk0 + i, 0), u1 = quads(sb, kk0 + i, 1);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, x + r * ldx + i, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], u0, xv);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], u1, xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_si512(out[r], acc[r][0]);
      _mm512_storeu_si512(out[r] + 16, acc[r][1]);
    }
  }
};
#endif

// fn(micro-kernel of type T over `data`) with the fastest micro-kernel this build has for it.
template <int64_t T, typename Fn>
inline void with_dots(const uint8_t* data, int64_t k, Fn&& fn) {
#if defined(PAGODA_GGUF_VNNI)
  fn(VnniDots<T>(data, k));
#else
  fn(RefDots<T>(data, k));
#endif
}

}  // namespace pagoda_gguf
