// GGUF's block formats (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0) held as stored, regrouped into the portable panels of
// quant_vpanel_linear.cpp: one row of the table below per GGML type names its block decoder, and the panel driver
// runs every row of the table.
//
// A weight in these formats is a list of segments (PackedWeight format "gguf", kernels/gguf_blocks.py), each of
// one GGML type: [panels, K / block, bytes] uint8, where one super-block panel holds the same bytes as P = 2W GGUF
// blocks of that type (one per output column), regrouped so that every field of a column sits in its lane:
//   d [P] fp16, dmin [P] fp16 (types with a min), sub-block scales [groups][P] (uint8; Q6_K int8), mins [groups][P],
//   low nibbles [block][W] (byte j: column j low, column j + W high, as vpanels' INT4), then the code bits above
//   the nibble [block][P * high / 8] (column c at bit c * high of each k's little-endian field); 8-bit codes (Q8_0)
//   are signed bytes [block][P] instead of the two planes.
// A code q (0 .. 2^bits - 1) is the weight gguf-py dequantizes: (d * sc) * (q - bias) - dmin * m, where every
// product is exact in fp32, so the group epilogue's s = d * sc and o = -dmin * m are gguf-py's own numbers.
#pragma once

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
enum GgmlType : int64_t { kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// One row per type: weights per super-block and per scale, code bits above the low nibble, the code's bias, whether
// it has per-sub-block scales (else d alone) and mins, and whether the sub-block scales are signed.
template <int64_t T>
struct Traits;
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
struct Traits<kQ8_0> {
  static constexpr int kBlock = 32, kGroup = 32, kHigh = 4, kBias = 0;  // kHigh 4: whole signed bytes
  static constexpr bool kSubScales = false, kMin = false, kSignedScales = false;
};

// fn(std::integral_constant<int64_t, T>) for a type known only at run time; false for a type not in the table.
template <typename Fn>
inline bool dispatch_type(int64_t type, Fn&& fn) {
  switch (type) {
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); return true;
    case kQ5_K: fn(std::integral_constant<int64_t, kQ5_K>{}); return true;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); return true;
    case kQ5_0: fn(std::integral_constant<int64_t, kQ5_0>{}); return true;
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
      const uint8_t* m = b + 4 * P + kGroups * P + j * P;
      r.o0 = -(pagoda_simd::vload_half(dmin) * widen(m));
      r.o1 = -(pagoda_simd::vload_half(dmin + W) * widen(m + W));
    }
    return r;
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

}  // namespace pagoda_gguf
