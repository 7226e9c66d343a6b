// fp32 <-> bf16 for 16 AVX-512 lanes, shared by the kernels that store bf16 from fp32 math.
#pragma once

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
#endif
