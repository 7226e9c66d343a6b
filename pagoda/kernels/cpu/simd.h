// Portable SIMD through GCC/Clang vector extensions, shared by the kernels written once for every ISA (paged
// attention, the row-major quantized linears, the fused elementwise ops, argmax): the compiler lowers a vector to the widest registers -march
// allows (AVX-512: one zmm; AVX2: one ymm; NEON: one q register), so the same source is the x86 build CI
// tests and the Arm build test_kernels_arm.py compiles. ISA-specific tiles live beside it where they pay.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace pagoda_simd {

// W fp32 lanes per vector: one register. (On NEON a pair of 4-lane registers as one 8-lane vector would be
// lowered lane by lane wherever a conversion is involved.)
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__ARM_NEON)
#define PAGODA_SIMD_NEON 1
constexpr int W = 4;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));

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
#elif defined(PAGODA_SIMD_NEON)
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

// Lane-wise max and min, one instruction each (GCC keeps a ?: as compare and blend). Where a lane holds a NaN
// the result differs between ISAs (x86: b; NEON: NaN), so callers keep NaNs away or do not care.
inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#elif defined(PAGODA_SIMD_NEON)
  return (vf)vmaxq_f32((float32x4_t)a, (float32x4_t)b);
#else
  return a > b ? a : b;
#endif
}
inline vf vmin(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#elif defined(PAGODA_SIMD_NEON)
  return (vf)vminq_f32((float32x4_t)a, (float32x4_t)b);
#else
  return a < b ? a : b;
#endif
}

// W bytes widened to W int32 lanes, unsigned or signed. GCC 12 lowers __builtin_convertvector from bytes to a
// wider vector element by element (about 30 scalar instructions for 8 bytes), so each ISA gets its one widening
// instruction here.
template <bool Signed>
inline vi vload_widen(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vi)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vi)(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#elif defined(PAGODA_SIMD_NEON)
  uint32_t four;
  std::memcpy(&four, p, sizeof(four));  // exactly W bytes: no read past the codes
  const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(four));
  if constexpr (Signed) return (vi)vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(b))));
  else return (vi)vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
#else
  const auto* b = reinterpret_cast<const uint8_t*>(p);
  vi r;
  for (int i = 0; i < W; ++i) r[i] = Signed ? static_cast<int32_t>(static_cast<int8_t>(b[i])) : b[i];
  return r;
#endif
}

// W bf16 (raw bits) widened to fp32, exactly: the 16 bits become the high half. Like vload_widen, one widening
// instruction per ISA (GCC 12 splits __builtin_convertvector's, and on NEON goes lane by lane).
inline vf vload_bf16(const void* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#elif defined(PAGODA_SIMD_NEON)
  return (vf)vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16);
#else
  uint16_t h[W];
  std::memcpy(h, p, sizeof(h));
  vu r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<uint32_t>(h[i]) << 16;
  return (vf)r;
#endif
}

// fp32 rounded to bf16 as c10::BFloat16 rounds (to nearest even; any NaN becomes 0x7FC0): the bf16 bits in the
// low half of each lane, and that value back as fp32.
inline vu vround_bf16_bits(vf v) {
  const vu b = (vu)v;
  const vu h = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return v != v ? vu{} + 0x7FC0u : h;
}
inline vf vround_bf16(vf v) { return (vf)(vround_bf16_bits(v) << 16); }

// fp32 -> W bf16 (raw bits), rounded as vround_bf16: the low halves narrowed by one instruction per ISA.
// Returns the value stored, as fp32.
inline vf vstore_bf16(void* p, vf v) {
  const vu h = vround_bf16_bits(v);
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)h));
#elif defined(__AVX2__)
  const __m256i x = (__m256i)h;  // each lane <= 0xFFFF: the unsigned saturation of packus keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
#elif defined(PAGODA_SIMD_NEON)
  vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32((uint32x4_t)h));
#else
  uint16_t o[W];
  for (int i = 0; i < W; ++i) o[i] = static_cast<uint16_t>(h[i]);
  std::memcpy(p, o, sizeof(o));
#endif
  return (vf)(h << 16);
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so n ln2 is exact), e^r by its degree-7 Taylor
// polynomial (truncation < 1e-8 relative, below fp32's half-ulp), scaled by 2^n through the exponent bits.
// Inputs are clamped to [-87, 88], where 2^n and e^x stay normal fp32. n = x log2e rounded to nearest by
// one FMA onto M = 1.5 * 2^23 + 127 (whose ulp is 1), so t = M + n also holds n + 127 in its low mantissa bits:
// shifted into the exponent field they are 2^n, with no rounding or conversion instruction on any ISA.
inline vf vexp(vf x) {
  constexpr float M = 12583039.f;  // 1.5 * 2^23 + 127
  x = vmin(vmax(x, vsplat(-87.f)), vsplat(88.f));
  const vf t = vfma(x, vsplat(1.44269504088896341f), vsplat(M));
  const vf n = t - M;
  vf r = vfma(n, vsplat(-0.693145751953125f), x);
  r = vfma(n, vsplat(-1.428606765330187e-06f), r);
  vf p = vsplat(1.f / 5040.f);
  p = vfma(p, r, vsplat(1.f / 720.f));
  p = vfma(p, r, vsplat(1.f / 120.f));
  p = vfma(p, r, vsplat(1.f / 24.f));
  p = vfma(p, r, vsplat(1.f / 6.f));
  p = vfma(p, r, vsplat(0.5f));
  p = vfma(p, r, vsplat(1.f));
  p = vfma(p, r, vsplat(1.f));
  return p * (vf)((vu)t << 23);
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
#if defined(__AVX__)
// hsum's tree over 8 lanes of a 256-bit register, which kernels with their own AVX2 registers share.
inline float hsum8(__m256 h) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif
inline float hsum(vf v) {
  // The same tree in registers (each step adds the upper half of the lanes onto the lower half), so the bits do
  // not depend on the ISA's path.
#if defined(__AVX512F__)
  const __m512 z = (__m512)v;
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))));
#elif defined(__AVX__)
  return hsum8((__m256)v);
#elif defined(PAGODA_SIMD_NEON)
  const float32x4_t q = (float32x4_t)v;
  const float32x2_t p = vadd_f32(vget_low_f32(q), vget_high_f32(q));
  return vget_lane_f32(p, 0) + vget_lane_f32(p, 1);
#else
  float a[W];
  std::memcpy(a, &v, sizeof(a));
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
#endif
}

// W IEEE fp16 values (raw bits) widened to fp32, exactly (subnormals included): one conversion instruction per ISA
// (F16C, AVX-512, NEON). Quantized weights keep scales that a GGUF stored in fp16 as fp16 (half their bytes).
inline vf vload_half(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(PAGODA_SIMD_NEON)
  return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#else
  vf r;
  for (int i = 0; i < W; ++i) {
    const uint32_t h = p[i], sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t u;
    if (e == 0) {  // zero or subnormal: m * 2^-24
      const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
      std::memcpy(&u, &f, sizeof(u));
      u |= sign;
    } else {
      u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    }
    std::memcpy(&r[i], &u, sizeof(u));
  }
  return r;
#endif
}

// dst[j][i] = src[i][j] for a W x W fp32 block (rows lds / ldd floats apart), in registers: pairs, then quads
// within 128-bit lanes, then the lanes themselves (AVX-512: ~50 shuffles where a scalar loop moves 256 floats
// one by one through memory; AVX2 24, NEON 8).
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
#if defined(__AVX512F__)
  __m512 r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + c], 128-bit lane L: column 4L + c of rows 4a..4a+3
    u[4 * a + 0] = _mm512_shuffle_ps(t[4 * a + 0], t[4 * a + 2], 0x44);
    u[4 * a + 1] = _mm512_shuffle_ps(t[4 * a + 0], t[4 * a + 2], 0xEE);
    u[4 * a + 2] = _mm512_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0x44);
    u[4 * a + 3] = _mm512_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    _mm512_storeu_ps(dst + (0 + c) * ldd, _mm512_shuffle_f32x4(v0, v2, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(v0, v2, 0xDD));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(v1, v3, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(v1, v3, 0xDD));
  }
#elif defined(__AVX__)
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 2; ++a) {  // u[4a + c], 128-bit lane L: column 4L + c of rows 4a..4a+3
    u[4 * a + 0] = _mm256_shuffle_ps(t[4 * a + 0], t[4 * a + 2], 0x44);
    u[4 * a + 1] = _mm256_shuffle_ps(t[4 * a + 0], t[4 * a + 2], 0xEE);
    u[4 * a + 2] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0x44);
    u[4 * a + 3] = _mm256_shuffle_ps(t[4 * a + 1], t[4 * a + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
  }
#elif defined(PAGODA_SIMD_NEON)
  const float32x4x2_t a = vtrnq_f32(vld1q_f32(src), vld1q_f32(src + lds));  // (r0[0] r1[0] r0[2] r1[2]), odd
  const float32x4x2_t b = vtrnq_f32(vld1q_f32(src + 2 * lds), vld1q_f32(src + 3 * lds));
  vst1q_f32(dst, vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0])));
  vst1q_f32(dst + ldd, vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1])));
  vst1q_f32(dst + 2 * ldd, vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0])));
  vst1q_f32(dst + 3 * ldd, vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1])));
#else
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}

}  // namespace pagoda_simd
