// GGUF's block formats (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0, Q2_K, Q3_K, IQ4_XS, MXFP4) held as
// stored, regrouped into the portable panels of quant_vpanel_linear.cpp: one row of the table below per GGML type
// names its block decoders, Blocks (fp32 codes, for that file's portable driver) and, on AVX512-BF16 builds,
// DotBlocks (vdpbf16ps operands, for the bf16 panel driver of quant_panel_linear.cpp); each driver runs every row of
// the table.
//
// A weight in these formats is a list of segments (PackedWeight format "gguf", kernels/gguf_blocks.py), each of
// one GGML type: [panels, K / block, bytes] uint8, where one super-block panel holds the same bytes as P = 2W GGUF
// blocks of that type (one per output column), regrouped so that every field of a column sits in its lane:
//   d [P] fp16, dmin [P] fp16 (types with a min; Q4_1/Q5_1: m), sub-block scales [groups][P] (uint8; Q6_K int8),
//   mins [groups][P], low nibbles [block][W] (byte j: column j low, column j + W high, as vpanels' INT4), then the
//   code bits above the nibble [block][P * high / 8] (column c at bit c * high of each k's little-endian field);
//   8-bit codes (Q8_0) are signed bytes [block][P] instead of the two planes. A row's Layout (below) may drop the
//   nibble plane (every code bit in fields), add a second field above the first, hold d as an E8M0 byte [P], or keep
//   the sub-block scales packed as the file packs them (rows of [P] bytes, decoded per lane).
// A code q (0 .. 2^bits - 1) is the weight gguf-py dequantizes: (d * sc) * (q - bias) - dmin * m (Q4_1/Q5_1:
// d * q + m), where every product is exact in fp32, so the group epilogue's s = d * sc and o = -dmin * m (or m) are
// gguf-py's own numbers. With a value table (IQ4_NL, IQ4_XS, MXFP4) the code indexes it and the weight is
// s * table[q], again exact.
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
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};

// One row per type: weights per super-block and per scale, code bits above the low nibble, the code's bias, whether
// it has per-sub-block scales (else d alone) and mins, and whether the sub-block scales are signed. A min without
// sub-block scales is the block's own offset (Q4_1, Q5_1: w = d q + m); with them it is scaled by dmin and
// subtracted (K-quants: w = d sc q - dmin m).
template <int64_t T>
struct Traits;
template <>
struct Traits<kQ4_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 8;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};
template <>
struct Traits<kQ4_1> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = false, kMin = true, kSignedScales = false;
};
template <>
struct Traits<kQ4_K> {
  static constexpr int kBlock = 256, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = true, kMin = true, kSignedScales = false;
};
template <>
struct Traits<kQ5_K> {
  static constexpr int kBlock = 256, kGroup = 32, kHigh = 1, kBias = 0;
  static constexpr bool kSubScales = true, kMin = true, kSignedScales = false;
};
template <>
struct Traits<kQ6_K> {
  static constexpr int kBlock = 256, kGroup = 16, kHigh = 2, kBias = 32;
  static constexpr bool kSubScales = true, kMin = false, kSignedScales = true;
};
template <>
struct Traits<kQ5_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 1, kBias = 16;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};
template <>
struct Traits<kQ5_1> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 1, kBias = 0;
  static constexpr bool kSubScales = false, kMin = true, kSignedScales = false;
};
template <>
struct Traits<kQ8_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 4, kBias = 0;  // kHigh 4: whole signed bytes
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};

// What a row may add to its Traits; these defaults (every row that names none of it): a nibble plane of the codes'
// low 4 bits, no second field, d fp16, codes less kBias as the values, a byte a sub-block scale (and min).
struct PlainLayout {
  static constexpr int kLow = 4;         // code bits in the nibble plane (0: none, every bit in the fields)
  static constexpr int kTop = 0;         // bits of a second field, above kHigh's, [block][P * kTop / 8]
  static constexpr bool kE8M0 = false;   // d: an E8M0 exponent byte [P] (gguf-py's e8m0_to_fp32_half) for fp16 [P]
  static constexpr bool kLookup = false; // the code indexes kTable, whose int8 value is the weight over the scale
  static constexpr int kScaleRows = 0;   // else: the file's packed scales, rows of [P] bytes, read by scale() / min()
};
template <int64_t T>
struct Layout : PlainLayout {};
// IQ4_NL's non-linear grid (ggml-common.h kvalues_iq4nl, gguf-py's IQ4_NL.kvalues), which IQ4_XS's codes index too.
struct Iq4nlLayout : PlainLayout {
  static constexpr bool kLookup = true;
  static constexpr int8_t kTable[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
};

// IQ4_NL: fp16 d, 4-bit indices into the grid (Q4_0's bytes).
template <>
struct Traits<kIQ4_NL> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};
template <>
struct Layout<kIQ4_NL> : Iq4nlLayout {};

// Q2_K: 2-bit codes, 16 bytes of (4-bit sc, 4-bit m) as stored.
template <>
struct Traits<kQ2_K> {
  static constexpr int kBlock = 256, kGroup = 16, kHigh = 2, kBias = 0;
  static constexpr bool kSubScales = true, kMin = true, kSignedScales = false;
};
template <>
struct Layout<kQ2_K> : PlainLayout {
  static constexpr int kLow = 0, kScaleRows = 16;
  template <class Row> static vi scale(const Row& row, int64_t j) { return row(j) & 0xF; }
  template <class Row> static vi min(const Row& row, int64_t j) { return row(j) >> 4; }
};
// Q3_K: 2 low bits and hmask's bit (the code low + 4 high, less 4), 12 bytes of 6-bit scales (less 32) as stored.
template <>
struct Traits<kQ3_K> {
  static constexpr int kBlock = 256, kGroup = 16, kHigh = 2, kBias = 4;
  static constexpr bool kSubScales = true, kMin = false, kSignedScales = true;
};
template <>
struct Layout<kQ3_K> : PlainLayout {
  static constexpr int kLow = 0, kTop = 1, kScaleRows = 12;
  template <class Row> static vi scale(const Row& row, int64_t j) {
    const int lo = static_cast<int>(4 * (j / 8)), hi = static_cast<int>(2 * (j / 4));
    return (((row(j % 8) >> lo) & 0xF) | (((row(8 + j % 4) >> hi) & 3) << 4)) - 32;
  }
};
// IQ4_XS: IQ4_NL's grid, 6-bit scales (less 32) as stored: scales_h (2 bytes), then scales_l (4).
template <>
struct Traits<kIQ4_XS> {
  static constexpr int kBlock = 256, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = true, kMin = false, kSignedScales = true;
};
template <>
struct Layout<kIQ4_XS> : Iq4nlLayout {
  static constexpr int kScaleRows = 6;
  template <class Row> static vi scale(const Row& row, int64_t j) {
    const int lo = static_cast<int>(4 * (j % 2)), hi = static_cast<int>(2 * (j % 4));
    return (((row(2 + j / 2) >> lo) & 0xF) | (((row(j / 4) >> hi) & 3) << 4)) - 32;
  }
};
// MXFP4: an E8M0 exponent per 32, e2m1 codes through gguf-py's doubled table (its d is 2^(e - 128), halved).
template <>
struct Traits<kMXFP4> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 0, kBias = 0;
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};
template <>
struct Layout<kMXFP4> : PlainLayout {
  static constexpr bool kE8M0 = true, kLookup = true;
  static constexpr int8_t kTable[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
};

// gguf-py's e8m0_to_fp32_half of widened exponent bytes: 2^(e - 128) as fp32 bits, subnormal below e = 2.
inline vf e8m0_half(vi e) { return (vf)(e < 2 ? (vi{} + 0x00200000) << e : (e - 1) << 23); }

// table[idx] per lane (idx 0 .. 15).
inline vf lookup16(const int8_t* table, vi idx) {
#if defined(__AVX512F__)
  const __m512 t = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))));
  return (vf)_mm512_permutexvar_ps((__m512i)idx, t);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  const __m256i i = (__m256i)idx;  // bit 3 of the index picks the table's half
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), i);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), i);
  return (vf)_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
#else
  vf r;
  for (int i = 0; i < W; ++i) r[i] = static_cast<float>(table[idx[i]]);
  return r;
#endif
}

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
    case kQ2_K: fn(std::integral_constant<int64_t, kQ2_K>{}); return true;
    case kQ3_K: fn(std::integral_constant<int64_t, kQ3_K>{}); return true;
    case kIQ4_XS: fn(std::integral_constant<int64_t, kIQ4_XS>{}); return true;
    case kMXFP4: fn(std::integral_constant<int64_t, kMXFP4>{}); return true;
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
  using Lay = Layout<T>;
  static constexpr int64_t kType = T;
  static constexpr int kGroups = Tr::kBlock / Tr::kGroup;
  static constexpr int64_t kScOffset = (Lay::kE8M0 ? P : 2 * P) + (Tr::kMin ? 2 * P : 0);  // after d (and dmin)
  static constexpr int64_t kMeta =
      kScOffset + (Lay::kScaleRows ? Lay::kScaleRows * P : Tr::kSubScales ? kGroups * P * (Tr::kMin ? 2 : 1) : 0);
  static constexpr bool kWholeBytes = Tr::kHigh == 4;
  static constexpr int64_t kLowBytes = Lay::kLow ? W : 0;                     // per k
  static constexpr int64_t kHighBytes = kWholeBytes ? 0 : P * Tr::kHigh / 8;  // per k
  static constexpr int64_t kTopBytes = P * Lay::kTop / 8;                     // per k
  static constexpr int64_t kBytes = kMeta + Tr::kBlock * (kWholeBytes ? P : kLowBytes + kHighBytes + kTopBytes);

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
    const int64_t j = g % kGroups;
    if constexpr (Lay::kE8M0 || Lay::kScaleRows > 0) return packed_group(b, j);
    Group r{pagoda_simd::vload_half(d), pagoda_simd::vload_half(d + W), vf{}, vf{}};
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
  // A Layout's group: d from E8M0 or fp16, the sub-block scale (and min) from the packed rows, per lane.
  inline Group packed_group(const uint8_t* b, int64_t j) const {
    Group r;
    if constexpr (Lay::kE8M0) {
      r.s0 = e8m0_half(pagoda_simd::vload_widen<false>(b));
      r.s1 = e8m0_half(pagoda_simd::vload_widen<false>(b + W));
    } else {
      r.s0 = pagoda_simd::vload_half(reinterpret_cast<const uint16_t*>(b));
      r.s1 = pagoda_simd::vload_half(reinterpret_cast<const uint16_t*>(b) + W);
    }
    r.o0 = r.o1 = vf{};
    if constexpr (Lay::kScaleRows > 0) {
      const uint8_t* rows = b + kScOffset;
      auto lo = [&](int64_t i) { return pagoda_simd::vload_widen<false>(rows + i * P); };
      auto hi = [&](int64_t i) { return pagoda_simd::vload_widen<false>(rows + i * P + W); };
      r.s0 *= __builtin_convertvector(Lay::scale(lo, j), vf);
      r.s1 *= __builtin_convertvector(Lay::scale(hi, j), vf);
      if constexpr (Tr::kMin) {
        const auto* dmin = reinterpret_cast<const uint16_t*>(b + 2 * P);
        r.o0 = -(pagoda_simd::vload_half(dmin) * __builtin_convertvector(Lay::min(lo, j), vf));
        r.o1 = -(pagoda_simd::vload_half(dmin + W) * __builtin_convertvector(Lay::min(hi, j), vf));
      }
    }
    return r;
  }
  // Adds a field of Bits per column (column c at bits Bits c of the k's P * Bits / 8 bytes at f), at bit At.
  template <int Bits, int At>
  static void add_field(const uint8_t* f, vi& a, vi& c) {
    constexpr int half = W * Bits;  // bits of one vector's columns
    uint64_t v = 0;
    std::memcpy(&v, f, P * Bits / 8);
    const uint32_t flo = static_cast<uint32_t>(half == 32 ? v : v & ((uint64_t{1} << half) - 1));
    const uint32_t fhi = static_cast<uint32_t>(v >> half);
    const vu shift = lane_index() * static_cast<uint32_t>(Bits);
    constexpr uint32_t mask = (1u << Bits) - 1;
    a |= (vi)((((vu{} + flo) >> shift) & mask) << At);
    c |= (vi)((((vu{} + fhi) >> shift) & mask) << At);
  }
  inline void load(int64_t p, int64_t k, vf& lo, vf& hi) const {
    const uint8_t* b = w + (p * nsb + k / Tr::kBlock) * kBytes + kMeta;
    const int64_t kk = k % Tr::kBlock;
    if constexpr (kWholeBytes) {
      lo = __builtin_convertvector(pagoda_simd::vload_widen<true>(b + kk * P), vf);
      hi = __builtin_convertvector(pagoda_simd::vload_widen<true>(b + kk * P + W), vf);
      return;
    }
    vi a{}, c{};
    if constexpr (Lay::kLow > 0) {
      const vi v = pagoda_simd::vload_widen<false>(b + kk * W);
      a = v & 0xF;
      c = v >> 4;
    }
    if constexpr (Tr::kHigh > 0 && !kWholeBytes)
      add_field<Tr::kHigh, Lay::kLow>(b + Tr::kBlock * kLowBytes + kk * kHighBytes, a, c);
    if constexpr (Lay::kTop > 0)
      add_field<Lay::kTop, Lay::kLow + Tr::kHigh>(b + Tr::kBlock * (kLowBytes + kHighBytes) + kk * kTopBytes, a, c);
    if constexpr (Lay::kLookup) {
      lo = lookup16(Lay::kTable, a);
      hi = lookup16(Lay::kTable, c);
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

// bitshuffle's selectors for z's byte 16 i + j (k i, column c = 16 h + j), each in the 64-bit lane 2 i + j / 8 that
// holds k i's field: bit c (a field of 1 bit), or bits 2c and 2c + 1 (of 2 bits); one row of 64 per (h, bit).
constexpr std::array<uint8_t, 256> field_selectors(int bits) {
  std::array<uint8_t, 256> t{};
  for (int r = 0; r < 4; ++r)  // r = 2 h + bit
    for (int i = 0; i < 64; ++i)
      t[64 * r + i] = static_cast<uint8_t>(bits == 2 ? 2 * (16 * (r / 2) + i % 16) + r % 2 : 16 * (r / 2) + i % 16);
  return t;
}
// The bf16 bits of an integer of at most 8 significant bits (exactly).
constexpr uint16_t bf16_of(int v) {
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> e) > 1) ++e;
  return a == 0 ? 0 : static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((127 + e) << 7) | (((a << 7) >> e) & 0x7F));
}

// One segment as quant_panel_linear.cpp's bf16 panel driver reads it (the interface of its CodePanels), over the
// same AVX-512 panels as Blocks: each 32-column panel is two of the driver's 16-column panels (v = 2 p + h, h: the
// low or high nibbles), and per block of 8 k a panel's codes become four vdpbf16ps operands, operand o holding
// k = 2o + j of column c at word 2c + j (one byte permute per 4 k, then unpacks against 0x43 bytes). A code q of up
// to 7 bits becomes the word 0x43qq, the bf16 number 128 + q exactly (as the INT4 panels' codes), so each product
// with a bf16 x is exact in fp32, and the group epilogue takes the carry 128 + bias off with the offsets:
// w x = s (128 + q) x + (o - (128 + bias) s) x. Q8_0's signed bytes become the bf16 integers they are, through fp32
// (as Int8Codes); a table's index (IQ4_NL, IQ4_XS, MXFP4) becomes its value's bf16 word (an integer of at most 7
// bits, exact) through vpermw, with no carry.
// Blocks::load is the reference each decodes as.
template <int64_t T>
struct DotBlocks {
  using B = Blocks<T>;
  using Tr = Traits<T>;
  using Lay = Layout<T>;
  static constexpr bool kWholeBytes = B::kWholeBytes;
  static constexpr float kCarry = kWholeBytes || Lay::kLookup ? 0.f : 128.f + Tr::kBias;
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
  // field_selectors of the fields' widths.
  static constexpr std::array<uint8_t, 256> kBits = field_selectors(Tr::kHigh);
  static constexpr std::array<uint8_t, 256> kTopBits = field_selectors(Lay::kTop);
  // A table's values as the bf16 words vpermw picks (exact: every int8 is a bf16 number).
  static constexpr std::array<uint16_t, 32> kWords = [] {
    std::array<uint16_t, 32> t{};
    if constexpr (Lay::kLookup)
      for (int i = 0; i < 16; ++i) t[i] = bf16_of(Lay::kTable[i]);
    return t;
  }();
  // z's bytes plus a field's bits (column c at bits Bits c of each k's field, k 4 z4 .. 4 z4 + 3 from f) at bit At.
  template <int Bits, int At>
  static __m512i add_field(__m512i z, const uint8_t* f, int64_t h, const std::array<uint8_t, 256>& sel) {
    if constexpr (Bits == 1) {  // a 32-bit field per k, column c at bit c
      const __m512i lanes = _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                     _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)f)));
      const __mmask64 m = _mm512_bitshuffle_epi64_mask(lanes, row(sel.data(), 2 * h));
      return _mm512_mask_add_epi8(z, m, z, _mm512_set1_epi8(1 << At));
    } else {  // a 64-bit field per k, column c at bits 2c, 2c + 1
      const __m512i lanes = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0),
                                                     _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)f)));
      const __mmask64 m0 = _mm512_bitshuffle_epi64_mask(lanes, row(sel.data(), 2 * h));
      const __mmask64 m1 = _mm512_bitshuffle_epi64_mask(lanes, row(sel.data(), 2 * h + 1));
      z = _mm512_mask_add_epi8(z, m0, z, _mm512_set1_epi8(1 << At));
      return _mm512_mask_add_epi8(z, m1, z, _mm512_set1_epi8(2 << At));
    }
  }
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
      __m512i z = _mm512_setzero_si512();
      if constexpr (Lay::kLow > 0)
        z = _mm512_gf2p8affine_epi64_epi8(_mm512_loadu_si512(sb + (kk + 4 * z4) * W), nibble, 0);
      const uint8_t* fields = sb + Tr::kBlock * B::kLowBytes;
      if constexpr (Tr::kHigh > 0)
        z = add_field<Tr::kHigh, Lay::kLow>(z, fields + (kk + 4 * z4) * B::kHighBytes, h, kBits);
      if constexpr (Lay::kTop > 0)
        z = add_field<Lay::kTop, Lay::kLow + Tr::kHigh>(
            z, fields + Tr::kBlock * B::kHighBytes + (kk + 4 * z4) * B::kTopBytes, h, kTopBits);
      z = _mm512_permutexvar_epi8(lanes_of, z);
      if constexpr (Lay::kLookup) {  // the indices as words, then their values' bf16 words
        const __m512i words = _mm512_loadu_si512(kWords.data());
        op[2 * z4] = (__m512bh)_mm512_permutexvar_epi16(_mm512_unpacklo_epi8(z, _mm512_setzero_si512()), words);
        op[2 * z4 + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_unpackhi_epi8(z, _mm512_setzero_si512()), words);
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
    if constexpr (Lay::kE8M0 || Lay::kScaleRows > 0) return packed_group(sb, g % kGroups, h, carried);
    __m512 s = d_of(sb, 0, h);
    const int64_t j = g % kGroups * P + 16 * h;  // the half's bytes of sub-block g
    if constexpr (Tr::kSubScales) s = _mm512_mul_ps(s, bytes_of(sb + kScOffset + j, Tr::kSignedScales));
    __m512 o = _mm512_setzero_ps();
    if constexpr (Tr::kMin && Tr::kSubScales)
      o = _mm512_sub_ps(o, _mm512_mul_ps(d_of(sb, 2 * P, h), bytes_of(sb + kMOffset + j, false)));
    else if constexpr (Tr::kMin) o = d_of(sb, 2 * P, h);  // the block's own offset m
    return {s, carried ? _mm512_fmadd_ps(s, _mm512_set1_ps(-kCarry), o) : o};
  }
  // A Layout's group (Blocks::packed_group's numbers for the half's 16 columns).
  GroupTerms packed_group(const uint8_t* sb, int64_t j, int h, bool carried) const {
    __m512 s;
    if constexpr (Lay::kE8M0)
      s = (__m512)e8m0_half((vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sb + 16 * h))));
    else
      s = d_of(sb, 0, h);
    __m512 o = _mm512_setzero_ps();
    if constexpr (Lay::kScaleRows > 0) {
      auto rows = [&](int64_t i) {
        return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sb + B::kScOffset + i * P + 16 * h)));
      };
      s = _mm512_mul_ps(s, (__m512)__builtin_convertvector(Lay::scale(rows, j), vf));
      if constexpr (Tr::kMin)
        o = _mm512_sub_ps(o, _mm512_mul_ps(d_of(sb, 2 * P, h), (__m512)__builtin_convertvector(Lay::min(rows, j), vf)));
    }
    return {s, carried ? _mm512_fmadd_ps(s, _mm512_set1_ps(-kCarry), o) : o};
  }
};
#endif

}  // namespace pagoda_gguf
