// fp32 <-> the stored dtype (fp32, or a 16-bit bf16 type such as c10::BFloat16), shared by the kernels that
// compute in fp32 and store in the tensor's dtype. Portable (simd.h's W lanes); the AVX-512 kernels' 16-lane
// names are the same functions on __m512.
#pragma once

#include <type_traits>

#include "simd.h"

namespace pagoda_simd {

// W values of T as fp32, and back (bf16: rounded to nearest even, as torch's casts do).
template <typename T>
inline vf vload_as(const T* p) {
  static_assert(std::is_same_v<T, float> || sizeof(T) == 2, "fp32 or bf16");
  if constexpr (std::is_same_v<T, float>) return vload(p);
  else return vload_bf16(p);
}

// Returns the value stored, as fp32.
template <typename T>
inline vf vstore_as(T* p, vf v) {
  static_assert(std::is_same_v<T, float> || sizeof(T) == 2, "fp32 or bf16");
  if constexpr (std::is_same_v<T, float>) {
    vstore(p, v);
    return v;
  } else {
    return vstore_bf16(p, v);
  }
}

// The value a T tensor would hold (bf16: rounded; fp32: as is).
template <typename T>
inline vf vround_as(vf v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return vround_bf16(v);
}

}  // namespace pagoda_simd

#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p) { return (__m512)pagoda_simd::vload_as(p); }

template <typename T>
inline void store16(T* p, __m512 v) { pagoda_simd::vstore_as(p, (pagoda_simd::vf)v); }
#endif
