// fp32 <-> bf16 for 16 AVX-512 lanes, shared by the kernels that store bf16 from fp32 math.
#pragma once

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>

// Round to bf16 (nearest even, as torch's casts do) and back, as a bf16 tensor would hold the value.
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 bf16 (raw bits) -> fp32: the 16 bits become the high half.
inline __m512 load_bf16x16(const void* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// fp32 -> 16 bf16 (raw bits), rounded to nearest even.
inline void store_bf16x16(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
}

// 16 values of T (float, or a 16-bit bf16 type such as c10::BFloat16) as fp32, and back.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else return load_bf16x16(p);
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(p, v);
  else store_bf16x16(p, v);
}

// The value a T tensor would hold (bf16: rounded; fp32: as is).
template <typename T>
inline __m512 as_stored(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return round_bf16(v);
}
#endif
