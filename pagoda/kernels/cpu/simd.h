// Portable SIMD through GCC/Clang vector extensions, shared by the kernels written once for every ISA (paged
// attention, the row-major quantized linears): the compiler lowers a vector to the widest registers -march
// allows (AVX-512: one zmm; AVX2: one ymm; NEON: a pair of q registers), so the same source is the x86 build CI
// tests and the Arm build test_kernels_arm.py compiles. ISA-specific tiles live beside it where they pay.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace pagoda_simd {

// W fp32 lanes per vector.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint8_t vb __attribute__((vector_size(W)));   // W bytes, widened by __builtin_convertvector
typedef int8_t vsb __attribute__((vector_size(W)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }
// a * b + c rounded once, always: left to -ffp-contract, whether a product is fused could differ between two
// instantiations of one kernel, and a row's sum would then depend on how many rows share the call.
inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__ARM_NEON)
  float32x4_t x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  std::memcpy(z, &c, sizeof(z));
  z[0] = vfmaq_f32(z[0], x[0], y[0]);
  z[1] = vfmaq_f32(z[1], x[1], y[1]);
  vf r;
  std::memcpy(&r, z, sizeof(r));
  return r;
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

template <typename V>
inline V vload_bytes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Horizontal reductions as trees (a fixed order, so a sum does not depend on how it is called): a sequential
// loop would be a W-deep dependency chain.
inline float hmax(vf v) {
  float a[W];
  std::memcpy(a, &v, sizeof(a));
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = std::max(a[i], a[i + w]);
  return a[0];
}
inline float hsum(vf v) {
  float a[W];
  std::memcpy(a, &v, sizeof(a));
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

}  // namespace pagoda_simd
