// 2W quantized codes as two fp32 vectors (simd.h's W lanes each), shared by the portable quantized kernels: the
// row-major one (quant_linear.cpp) and the panel one (quant_vpanel_linear.cpp). F is a LinearFormat's storage:
// kInt4: W bytes, low nibbles into a and high nibbles into b (the layout decides which columns those are);
// kInt8: 2W signed bytes; kFp8: 2W e4m3fn bytes.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear_formats.h"
#include "simd.h"
#include "vec_bf16.h"

namespace pagoda_simd {

template <int F>
inline void decode_codes(const uint8_t* p, vf& a, vf& b) {
  if constexpr (F == pagoda_cpu::kInt4) {
    const vi v = vload_widen<false>(p);
    a = __builtin_convertvector(v & 0xF, vf);
    b = __builtin_convertvector(v >> 4, vf);
  } else if constexpr (F == pagoda_cpu::kInt8) {
    a = __builtin_convertvector(vload_widen<true>(p), vf);
    b = __builtin_convertvector(vload_widen<true>(p + W), vf);
  } else {
    static_assert(F == pagoda_cpu::kFp8, "decode_codes: kInt4, kInt8 or kFp8");
    // e4m3fn -> fp32: magnitude bits shifted into an fp32 exponent/mantissa give value * 2^-120 (subnormals
    // included, as fp32 denormals); one multiply restores the scale.
    auto one = [](const uint8_t* q) {
      const vu v = (vu)vload_widen<false>(q);
      const vf mag = (vf)((v & 0x7F) << 20) * 1.329228e36f;  // 2^120
      return (vf)((vu)mag | ((v & 0x80) << 24));
    };
    a = one(p);
    b = one(p + W);
  }
}

// fn(std::integral_constant<int, F>) for a storage format known only at run time (kInt4, kInt8, else kFp8): the
// kernels' one switch from a format code to the decode_codes instantiation.
template <typename Fn>
inline void dispatch_codes(int64_t fmt, Fn&& fn) {
  if (fmt == pagoda_cpu::kInt4) fn(std::integral_constant<int, pagoda_cpu::kInt4>{});
  else if (fmt == pagoda_cpu::kInt8) fn(std::integral_constant<int, pagoda_cpu::kInt8>{});
  else fn(std::integral_constant<int, pagoda_cpu::kFp8>{});
}

// Each row's sums of x (fp32 or bf16 [M, K]) over groups of gs columns, fp32 [M, G]: the offset terms of every
// quantized kernel take them (and the 128 each INT4 code carries in the bf16 panels). W lanes, then hsum's tree.
template <typename T>
std::vector<float> group_sums(const T* x, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  std::vector<float> xs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const T* r = x + m * K + g * gs;
      vf sum{};
      int64_t k = 0;
      for (; k + W <= gs; k += W) sum += vload_as(r + k);
      float total = hsum(sum);
      for (; k < gs; ++k) total += static_cast<float>(r[k]);
      xs[m * G + g] = total;
    }
  return xs;
}

}  // namespace pagoda_simd
