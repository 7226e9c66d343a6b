// GGUF's block formats (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0) held as stored, regrouped into the
// portable panels of quant_vpanel_linear.cpp: one row of the table below per GGML type names its block decoders,
// Blocks (fp32 codes, for that file's portable driver) and, on AVX512-BF16 builds, DotBlocks (vdpbf16ps operands,
// for the bf16 panel driver of quant_panel_linear.cpp); each driver runs every row of the table.
//
// A weight in these formats is a list of segments (PackedWeight format "gguf", kernels/gguf_blocks.py), each of
// one GGML type: [panels, K / block, bytes] uint8, where one super-block panel holds the same bytes as P = 2W GGUF
// blocks of that type (one per output column), regrouped so that every field of a column sits in its lane:
//   d [P] fp16, dmin [P] fp16 (types with a min; Q4_1/Q5_1: m), sub-block scales [groups][P] (uint8; Q6_K int8),
//   mins [groups][P], low nibbles [block][W] (byte j: column j low, column j + W high, as vpanels' INT4), then the
//   code bits above the nibble [block][P * high / 8] (column c at bit c * high of each k's little-endian field);
//   8-bit codes (Q8_0) are signed bytes [block][P] instead of the two planes.
// A code q (0 .. 2^bits - 1) is the weight gguf-py dequantizes: (d * sc) * (q - bias) - dmin * m (Q4_1/Q5_1:
// d * q + m; IQ4_NL: d * table[q]), where every product is exact in fp32, so the group epilogue's s = d * sc and
// o = -dmin * m (or m) are gguf-py's own numbers.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace pagoda_gguf {

using pagoda_simd::vf;
using pagoda_simd::vi;
using pagoda_simd::vu;
using pagoda_simd::W;

constexpr int P = 2 * W;  // output columns per panel

// GGML type ids (ggml.h's enum ggml_type), as the segment table names them.
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20
};

// IQ4_NL's non-linear grid (ggml-common.h kvalues_iq4nl, gguf-py's IQ4_NL.kvalues): a code is an index into it.
alignas(64) constexpr float kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};

// One row per type: weights per super-block and per scale, code bits above the low nibble, the code's bias, whether
// it has per-sub-block scales (else d alone) and mins, whether the sub-block scales are signed, and whether a code
// indexes kIq4nlValues (else it is the integer it holds). A min without sub-block scales is the block's own offset
// (Q4_1, Q5_1: w = d q + m); with them it is scaled by dmin and subtracted (K-quants: w = d sc q - dmin m).
template <int64_t T>
struct Traits;
template <>
struct Traits<kQ4_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 8;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kQ4_1> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = false, kMin = true, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kQ4_K> {
  static constexpr int kBlock = 256, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = true, kMin = true, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kQ5_K> {
  static constexpr int kBlock = 256, kGroup = 32, kHigh = 1, kBias = 0;
  static constexpr bool kSubScales = true, kMin = true, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kQ6_K> {
  static constexpr int kBlock = 256, kGroup = 16, kHigh = 2, kBias = 32;
  static constexpr bool kSubScales = true, kMin = false, kSignedScales = true, kTable = false;
};
template <>
struct Traits<kQ5_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 1, kBias = 16;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kQ5_1> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 1, kBias = 0;
  static constexpr bool kSubScales = false, kMin = true, kSignedScales = false, kTable = false;
};
template <>
struct Traits<kIQ4_NL> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false, kTable = true;
};
template <>
struct Traits<kQ8_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 4, kBias = 0;  // kHigh 4: whole signed bytes
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false, kTable = false;
};

// fn(std::integral_constant<int64_t, T>) for a type known only at run time; false for a type not in the table.
template <typename Fn>
inline bool dispatch_type(int64_t type, Fn&& fn) {
  switch (type) {
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); return true;
    case kQ5_K: fn(std::integral_constant<int64_t, kQ5_K>{}); return true;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); return true;
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); return true;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); return true;
    case kQ5_0: fn(std::integral_constant<int64_t, kQ5_0>{}); return true;
    case kQ5_1: fn(std::integral_constant<int64_t, kQ5_1>{}); return true;
    case kIQ4_NL: fn(std::integral_constant<int64_t, kIQ4_NL>{}); return true;
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); return true;
    default: return false;
  }
}

inline vu lane_index() {
  vu r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<uint32_t>(i);
  return r;
}

// One segment as the panel driver reads it (the interface of quant_vpanel_linear.cpp's Codes): per k a panel's codes
// as two fp32 vectors, per group its scales and offsets.
template <int64_t T>
struct Blocks {
  using Tr = Traits<T>;
  static constexpr int64_t kType = T;
  static constexpr int kGroups = Tr::kBlock / Tr::kGroup;
  static constexpr int64_t kMeta = 2 * P * (Tr::kMin ? 2 : 1) + (Tr::kSubScales ? kGroups * P * (Tr::kMin ? 2 : 1) : 0);
  static constexpr bool kWholeBytes = Tr::kHigh == 4;
  static constexpr int64_t kHighBytes = kWholeBytes ? 0 : P * Tr::kHigh / 8;  // per k
  static constexpr int64_t kBytes = kMeta + Tr::kBlock * (kWholeBytes ? P : W + kHighBytes);

  const uint8_t* w;  // [panels, K / block, kBytes]
  int64_t K, G, gs, nsb;

  Blocks(const uint8_t* data, int64_t k) : w(data), K(k), G(k / Tr::kGroup), gs(Tr::kGroup), nsb(k / Tr::kBlock) {}
  static int64_t panel_bytes(int64_t k) { return k / Tr::kBlock * kBytes; }
  bool has_offsets() const { return Tr::kMin; }

  struct Group {
    vf s0, s1, o0, o1;
  };
  static vf widen(const uint8_t* p) {
    return __builtin_convertvector(pagoda_simd::vload_widen<Tr::kSignedScales>(p), vf);
  }
  inline Group group(int64_t p, int64_t g) const {
    const uint8_t* b = w + (p * nsb + g / kGroups) * kBytes;
    const auto* d = reinterpret_cast<const uint16_t*>(b);
    Group r{pagoda_simd::vload_half(d), pagoda_simd::vload_half(d + W), vf{}, vf{}};
    const int64_t j = g % kGroups;
    if constexpr (Tr::kSubScales) {
      const uint8_t* sc = b + 2 * P * (Tr::kMin ? 2 : 1) + j * P;
      r.s0 *= widen(sc);
      r.s1 *= widen(sc + W);
    }
    if constexpr (Tr::kMin) {
      const auto* dmin = reinterpret_cast<const uint16_t*>(b + 2 * P);
      if constexpr (Tr::kSubScales) {
        const uint8_t* m = b + 4 * P + kGroups * P + j * P;
        r.o0 = -(pagoda_simd::vload_half(dmin) * widen(m));
        r.o1 = -(pagoda_simd::vload_half(dmin + W) * widen(m + W));
      } else {
        r.o0 = pagoda_simd::vload_half(dmin);
        r.o1 = pagoda_simd::vload_half(dmin + W);
      }
    }
    return r;
  }
  // kIq4nlValues[q] per lane, as fp32 (q: 0 .. 15).
  static vf lookup(vi q) {
#if defined(__AVX512F__)
    return (vf)_mm512_permutexvar_ps((__m512i)q, _mm512_load_ps(kIq4nlValues));
#elif defined(__AVX2__)
    const __m256i i = (__m256i)q;  // bit 3 of the index picks the table's half
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(kIq4nlValues), i);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(kIq4nlValues + 8), i);
    return (vf)_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
#else
    vf r;
    for (int i = 0; i < W; ++i) r[i] = kIq4nlValues[q[i]];
    return r;
#endif
  }
  inline void load(int64_t p, int64_t k, vf& lo, vf& hi) const {
    const uint8_t* b = w + (p * nsb + k / Tr::kBlock) * kBytes + kMeta;
    const int64_t kk = k % Tr::kBlock;
    if constexpr (kWholeBytes) {
      lo = __builtin_convertvector(pagoda_simd::vload_widen<true>(b + kk * P), vf);
      hi = __builtin_convertvector(pagoda_simd::vload_widen<true>(b + kk * P + W), vf);
      return;
    }
    const vi v = pagoda_simd::vload_widen<false>(b + kk * W);
    vi a = v & 0xF, c = v >> 4;
    if constexpr (Tr::kHigh > 0 && !kWholeBytes) {
      constexpr int half = W * Tr::kHigh;  // bits of one vector's columns
      uint64_t f = 0;
      std::memcpy(&f, b + Tr::kBlock * W + kk * kHighBytes, kHighBytes);
      const uint32_t flo = static_cast<uint32_t>(half == 32 ? f : f & ((uint64_t{1} << half) - 1));
      const uint32_t fhi = static_cast<uint32_t>(f >> half);
      const vu shift = lane_index() * static_cast<uint32_t>(Tr::kHigh);
      constexpr uint32_t mask = (1u << Tr::kHigh) - 1;
      a |= (vi)((((vu{} + flo) >> shift) & mask) << 4);
      c |= (vi)((((vu{} + fhi) >> shift) & mask) << 4);
    }
    if constexpr (Tr::kTable) {
      lo = lookup(a);
      hi = lookup(c);
      return;
    }
    if constexpr (Tr::kBias != 0) {
      a -= Tr::kBias;
      c -= Tr::kBias;
    }
    lo = __builtin_convertvector(a, vf);
    hi = __builtin_convertvector(c, vf);
  }
  inline void prefetch(int64_t p, int64_t k) const {
    __builtin_prefetch(w + p * nsb * kBytes + (k + 64) * kBytes / Tr::kBlock, 0, 3);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BITALG__) && defined(__GFNI__)
#define PAGODA_GGUF_BF16 1
#endif

#if defined(__AVX512F__)
// A group's two epilogue terms for 16 columns: what multiplies the codes' dot product, and what multiplies the
// group's sum of x.
struct GroupTerms {
  __m512 scales, xsum;
};
#endif

#if defined(PAGODA_GGUF_BF16)

// One segment as quant_panel_linear.cpp's bf16 panel driver reads it (the interface of its CodePanels), over the
// same AVX-512 panels as Blocks: each 32-column panel is two of the driver's 16-column panels (v = 2 p + h, h: the
// low or high nibbles), and per block of 8 k a panel's codes become four vdpbf16ps operands, operand o holding
// k = 2o + j of column c at word 2c + j (one byte permute per 4 k, then unpacks against 0x43 bytes). A code q of up
// to 7 bits becomes the word 0x43qq, the bf16 number 128 + q exactly (as the INT4 panels' codes), so each product
// with a bf16 x is exact in fp32, and the group epilogue takes the carry 128 + bias off with the offsets:
// w x = s (128 + q) x + (o - (128 + bias) s) x. Q8_0's signed bytes become the bf16 integers they are, through fp32
// (as Int8Codes), and IQ4_NL's indices the bf16 words of their table values (integers of 7 bits, exact; no carry).
// Blocks::load is the reference each decodes as.
template <int64_t T>
struct DotBlocks {
  using B = Blocks<T>;
  using Tr = Traits<T>;
  static constexpr bool kWholeBytes = B::kWholeBytes;
  static constexpr float kCarry = kWholeBytes || Tr::kTable ? 0.f : 128.f + Tr::kBias;
  static constexpr int64_t kGroups = B::kGroups;
  static constexpr int64_t kScOffset = 2 * P * (Tr::kMin ? 2 : 1);  // the sub-block scales, after d (and dmin)
  static constexpr int64_t kMOffset = 4 * P + kGroups * P;         // the mins, after the scales

  static constexpr int64_t gs = Tr::kGroup;  // a constant: the tile's blocks of a group unroll whole
  const uint8_t* w;                            // [panels of P, K / block, B::kBytes]
  int64_t G, nsb;

  DotBlocks(const uint8_t* data, int64_t k) : w(data), G(k / Tr::kGroup), nsb(k / Tr::kBlock) {}
  static constexpr bool has_offsets() { return Tr::kMin; }

  // The super-block of 16-column panel v that holds k.
  const uint8_t* block(int64_t v, int64_t k) const { return w + ((v >> 1) * nsb + k / Tr::kBlock) * B::kBytes; }

  // vpermb's selectors that put z's codes (z: 4 k x 16 columns, byte 16 i + c) where unpacklo/hi_epi8 against 0x43
  // make the words 0x43qq of operands (k0, k1) and (k2, k3): word w = 8 L + m of 128-bit lane L takes byte m (lo) or
  // 8 + m (hi) of that lane, and holds k = 2 half + w % 2 of column w / 2.
  static constexpr std::array<uint8_t, 64> kLanes = [] {
    std::array<uint8_t, 64> t{};
    for (int i = 0; i < 64; ++i) {
      const int w = 8 * (i / 16) + i % 8, half = i % 16 / 8;
      t[i] = static_cast<uint8_t>(16 * (2 * half + w % 2) + w / 2);
    }
    return t;
  }();
  // vpermw's selectors from rows k (words 0-15) and k + 1 (words 16-31) to word 2c + j = row k + j, column c.
  static constexpr std::array<uint8_t, 64> kWordPairs = [] {
    std::array<uint8_t, 64> t{};
    for (int i = 0; i < 32; ++i) t[2 * i] = static_cast<uint8_t>(16 * (i % 2) + i / 2);  // little-endian 16-bit
    return t;
  }();
  // bitshuffle's selectors for z's byte 16 i + j (k i, column c = 16 h + j), each in the 64-bit lane 2 i + j / 8 that
  // holds k i's field: bit c (kHigh 1), or bits 2c and 2c + 1 (kHigh 2); one row of 64 per (h, bit).
  static constexpr std::array<uint8_t, 256> kBits = [] {
    std::array<uint8_t, 256> t{};
    for (int r = 0; r < 4; ++r)  // r = 2 h + bit
      for (int i = 0; i < 64; ++i)
        t[64 * r + i] =
            static_cast<uint8_t>(Tr::kHigh == 2 ? 2 * (16 * (r / 2) + i % 16) + r % 2 : 16 * (r / 2) + i % 16);
    return t;
  }();
  // kIq4nlValues as bf16 words (integers of 7 bits, each exact), split into low bytes (row 0) and high bytes (row 1),
  // the 16 of each repeated in every 128-bit lane for vpshufb.
  static constexpr std::array<uint8_t, 128> kTableBytes = [] {
    std::array<uint8_t, 128> t{};
    for (int i = 0; i < 64; ++i) {
      const int v = static_cast<int>(kIq4nlValues[i % 16]), a = v < 0 ? -v : v;
      int e = 0;
      while (a >> (e + 1)) ++e;
      const int bits = (v < 0 ? 0x8000 : 0) | (127 + e) << 7 | ((a << (7 - e)) & 0x7F);
      t[i] = static_cast<uint8_t>(bits & 0xFF);
      t[64 + i] = static_cast<uint8_t>(bits >> 8);
    }
    return t;
  }();
  static __m512i row(const uint8_t* t, int r) { return _mm512_loadu_si512(t + 64 * r); }

  // Block i of group g (k = g kGroup + 8i) of panel v: its codes, from the half's nibbles (h = v & 1: low or high).
  // No branch on h: GCC then keeps the tile's panels unrolled and its chains in registers.
  inline void operands(int64_t v, int64_t g, int i, __m512bh (&op)[4]) const {
    const int64_t h = v & 1;
    const uint8_t* sb = block(v, g * Tr::kGroup) + B::kMeta;
    const int64_t kk = g % kGroups * Tr::kGroup + 8 * i;
    if constexpr (kWholeBytes) {  // [block][P] signed bytes: rows k, k + 1 of the half's 16 columns, exact in bf16
      const __m512i pairs = row(kWordPairs.data(), 0);
      for (int o = 0; o < 4; ++o) {
        const uint8_t* r = sb + (kk + 2 * o) * P + 16 * h;
        auto row16 = [](const uint8_t* q) {  // 16 signed bytes as fp32
          return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
        };
        const __m512 a = row16(r), c = row16(r + P);
        op[o] = (__m512bh)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(c, a));  // words 2c + j
      }
      return;
    }
    // GF(2) affine maps of each byte onto its low nibble (h 0) or its high nibble shifted down (h 1): one
    // instruction for the shift and the mask, whichever the half. Row 7 - b of the matrix gives bit b.
    const __m512i nibble = _mm512_set1_epi64(h ? 0x1020408000000000LL : 0x0102040800000000LL);
    const __m512i c43 = _mm512_set1_epi8(0x43);
    const __m512i lanes_of = row(kLanes.data(), 0);
    for (int z4 = 0; z4 < 2; ++z4) {  // k 4 z4 .. 4 z4 + 3
      __m512i z = _mm512_gf2p8affine_epi64_epi8(_mm512_loadu_si512(sb + (kk + 4 * z4) * W), nibble, 0);
      if constexpr (Tr::kHigh == 1) {  // a 32-bit field per k, column c at bit c
        const __m512i f = _mm512_castsi128_si512(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + Tr::kBlock * W + (kk + 4 * z4) * 4)));
        const __m512i lanes =
            _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), f);
        const __mmask64 m = _mm512_bitshuffle_epi64_mask(lanes, row(kBits.data(), 2 * h));
        z = _mm512_mask_add_epi8(z, m, z, _mm512_set1_epi8(16));
      } else if constexpr (Tr::kHigh == 2) {  // a 64-bit field per k, column c at bits 2c, 2c + 1
        const __m512i f = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + Tr::kBlock * W + (kk + 4 * z4) * 8)));
        const __m512i lanes = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), f);
        const __mmask64 m4 = _mm512_bitshuffle_epi64_mask(lanes, row(kBits.data(), 2 * h));
        const __mmask64 m5 = _mm512_bitshuffle_epi64_mask(lanes, row(kBits.data(), 2 * h + 1));
        z = _mm512_mask_add_epi8(z, m4, z, _mm512_set1_epi8(16));
        z = _mm512_mask_add_epi8(z, m5, z, _mm512_set1_epi8(32));
      }
      z = _mm512_permutexvar_epi8(lanes_of, z);
      if constexpr (Tr::kTable) {  // each index's table value as its bf16 word: low byte and high byte by vpshufb
        const __m512i lo = _mm512_shuffle_epi8(row(kTableBytes.data(), 0), z);
        const __m512i hi = _mm512_shuffle_epi8(row(kTableBytes.data(), 1), z);
        op[2 * z4] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
        op[2 * z4 + 1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
      } else {
        op[2 * z4] = (__m512bh)_mm512_unpacklo_epi8(z, c43);
        op[2 * z4 + 1] = (__m512bh)_mm512_unpackhi_epi8(z, c43);
      }
    }
  }
  inline void prefetch(int64_t v, int64_t g, int i) const {
    // The bytes of 8 k, at their share of the super-block; the panel's two halves take alternate lines.
    constexpr int64_t kSpan = 8 * B::kBytes / Tr::kBlock;
    const int64_t kk = g % kGroups * Tr::kGroup + 8 * i;
    const uint8_t* p = block(v, g * Tr::kGroup) + kk * B::kBytes / Tr::kBlock;
    for (int64_t j = 0; j < (kSpan + 127) / 128; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(p + 64 * (v & 1) + 128 * j), _MM_HINT_T1);
  }

  __m512 d_of(const uint8_t* sb, int64_t field, int h) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + field + 32 * h)));
  }
  static __m512 bytes_of(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
  // Group g of panel v: s = d sc (d alone without sub-block scales) and -dmin m - carry s, each product exact in fp32.
  GroupTerms group(int64_t v, int64_t g, bool carried) const {
    const int h = static_cast<int>(v & 1);
    const uint8_t* sb = block(v, g * Tr::kGroup);
    __m512 s = d_of(sb, 0, h);
    const int64_t j = g % kGroups * P + 16 * h;  // the half's bytes of sub-block g
    if constexpr (Tr::kSubScales) s = _mm512_mul_ps(s, bytes_of(sb + kScOffset + j, Tr::kSignedScales));
    __m512 o = _mm512_setzero_ps();
    if constexpr (Tr::kMin && Tr::kSubScales)
      o = _mm512_sub_ps(o, _mm512_mul_ps(d_of(sb, 2 * P, h), bytes_of(sb + kMOffset + j, false)));
    else if constexpr (Tr::kMin) o = d_of(sb, 2 * P, h);  // the block's own offset m
    return {s, carried ? _mm512_fmadd_ps(s, _mm512_set1_ps(-kCarry), o) : o};
  }
};
#endif

}  // namespace pagoda_gguf
