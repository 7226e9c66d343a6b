// The integer dot products of GGUF blocks (gguf_blocks.h's panels) with int8 activations, the micro-kernels of
// gguf_a8_linear.cpp's driver: per weight group g of panel p and per activation row r, out[r][c] = the sum over the
// group's k of code(c, k) x[r][k], where code is the weight over its group's scale as Blocks::load gives it (q - bias,
// or the type's table value) and x the row's int8 values. Integer sums are exact, so every micro-kernel returns the
// same numbers; each may instead return the sum of (code + kCarry) x, the driver taking kCarry times the group's sum
// of x off. One per ISA, beside the reference every build has:
//   RefDots: Blocks::load's fp32 codes times x, FMA'd in fp32 (products of at most 128 x 128 over 32 k stay far below
//            2^24, so the fp32 sums are the integers), for any build (AVX-512 and Arm, and types no faster kernel
//            takes).
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

// fn(micro-kernel of type T over `data`) with the fastest micro-kernel this build has for it.
template <int64_t T, typename Fn>
inline void with_dots(const uint8_t* data, int64_t k, Fn&& fn) {
  fn(RefDots<T>(data, k));
}

}  // namespace pagoda_gguf
