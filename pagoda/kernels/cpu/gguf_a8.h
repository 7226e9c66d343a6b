// The integer dot products of GGUF blocks (gguf_blocks.h's panels) with int8 activations, the micro-kernels of
// gguf_a8_linear.cpp's driver: per weight group g of panel p and per activation row r, out[r][c] = the sum over the
// group's k of code(c, k) x[r][k], where code is the weight over its group's scale as Blocks::load gives it (q - bias,
// or the type's table value) and x the row's int8 values. Integer sums are exact, so every micro-kernel returns the
// same numbers; each may instead return the sum of (code + kCarry) x, the driver taking kCarry times the group's sum
// of x off. One per ISA, beside the reference every build has:
//   RefDots: Blocks::load's fp32 codes times x, FMA'd in fp32 (products of at most 128 x 128 over 32 k stay far below
//            2^24, so the fp32 sums are the integers), for any build (AVX-512 and Arm today);
//   Avx2Dots (x86-64-v3): each column's 4 k as the 4 bytes of a 32-bit lane, decoded from the panels' bytes by AVX2
//            shuffles, as vpmaddubsw's unsigned operand, its int16 pairs widened by vpmaddwd.
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

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PAGODA_GGUF_AVX2_DOTS 1

// Per 4 k (a step) a panel's codes as bytes, column c's 4 k in 32-bit lane c of two vectors (columns 0-7, 8-15), each
// row's 4 int8 values broadcast against them: vpmaddubsw sums adjacent products into int16, vpmaddwd widens. Its
// int16 saturates, so plain codes go in unsigned (q, carry kBias) and sum over kChunk steps before widening, as many
// as no int8 x can overflow; a table whose values span under 128 goes in less its least value (MXFP4, carried).
// Codes of either sign (Q8_0's bytes, IQ4_NL's grid) go in as |w| against x with w's sign (llama.cpp's vpsignb),
// widened every step: exact for x in [-127, 127], which is all the driver's rounding makes.
template <int64_t T>
struct Avx2Dots {
  using B = Blocks<T>;
  using Tr = Traits<T>;
  using Lay = Layout<T>;
  static_assert(P == 16, "the x86-64-v3 panels: 16 columns, two ymm of 8");
  static constexpr int kTableLow = [] {
    int m = 0;
    if constexpr (Lay::kLookup)
      for (int v : Lay::kTable) m = v < m ? v : m;
    return m;
  }();
  static constexpr int kMaxCode = [] {  // of the unsigned operand
    int m = (1 << (Lay::kLow + Tr::kHigh + Lay::kTop)) - 1;
    if constexpr (B::kWholeBytes) m = 128;
    if constexpr (Lay::kLookup) {
      m = 0;
      for (int v : Lay::kTable) m = v - kTableLow > m ? v - kTableLow : m;
    }
    return m;
  }();
  static constexpr bool kSigned = B::kWholeBytes || (Lay::kLookup && kMaxCode > 127);
  static constexpr int kCarry = kSigned ? 0 : Lay::kLookup ? -kTableLow : Tr::kBias;
  static constexpr int64_t kType = T;
  static constexpr int kSteps = Tr::kGroup / 4;
  static constexpr int kChunk = [] {  // steps per int16 sum: each lane gains at most 2 x 128 kMaxCode a step
    int n = 1;
    while (!kSigned && 2 * n <= kSteps && 256 * 2 * n * kMaxCode <= 32767) n *= 2;
    return n;
  }();
  static_assert(kSigned || 256 * kMaxCode <= 32767, "an unsigned code vpmaddubsw could saturate on");
  B b;

  Avx2Dots(const uint8_t* data, int64_t k) : b(data, k) {}

  // vpshufb's 4 x 4 byte transpose within each 128-bit lane: byte 4c + i from byte 4i + c.
  static constexpr std::array<uint8_t, 32> kTranspose = [] {
    std::array<uint8_t, 32> t{};
    for (int j = 0; j < 32; ++j) t[j] = static_cast<uint8_t>(4 * (j % 4) + j % 16 / 4);
    return t;
  }();
  // A field of Bits per column (Blocks::add_field), its 4 k's bytes in both 128-bit lanes: vpshufb's selectors of
  // the byte that holds column 8h + d, k i (32-bit lane d, byte i), one row of 32 per h; then each 32-bit lane's
  // shift to its column's bits, the same for its 4 k.
  template <int Bits>
  static constexpr std::array<uint8_t, 64> field_bytes() {
    std::array<uint8_t, 64> t{};
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 32; ++j) t[32 * h + j] = static_cast<uint8_t>(j % 4 * 2 * Bits + (8 * h + j / 4) * Bits / 8);
    return t;
  }
  template <int Bits>
  static __m256i field_shifts() {
    return _mm256_setr_epi32(0, Bits % 8, 2 * Bits % 8, 3 * Bits % 8, 4 * Bits % 8, 5 * Bits % 8, 6 * Bits % 8,
                             7 * Bits % 8);
  }
  static constexpr std::array<uint8_t, 64> kHighBytes = field_bytes<Tr::kHigh>();
  static constexpr std::array<uint8_t, 64> kTopBytes = field_bytes<Lay::kTop>();
  // The table as the unsigned operand takes it (less its least value), or as signed values.
  static constexpr std::array<int8_t, 16> kTableBytes = [] {
    std::array<int8_t, 16> t{};
    if constexpr (Lay::kLookup)
      for (int i = 0; i < 16; ++i) t[i] = static_cast<int8_t>(Lay::kTable[i] - (kSigned ? 0 : kTableLow));
    return t;
  }();

  static __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

  // c[0], c[1] |= a field's bits (Bits per column, 4 k from f) at bit At.
  template <int Bits, int At>
  static inline void add_field(const uint8_t* f, const std::array<uint8_t, 64>& sel, __m256i (&c)[2]) {
    __m256i v;
    if constexpr (Bits == 1) {
      int64_t q;
      std::memcpy(&q, f, 8);
      v = _mm256_set1_epi64x(q);
    } else {
      v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f)));
    }
    const __m256i shifts = field_shifts<Bits>(), mask = _mm256_set1_epi8((1 << Bits) - 1);
    for (int h = 0; h < 2; ++h) {
      const __m256i bits = _mm256_srlv_epi32(_mm256_shuffle_epi8(v, load(sel.data() + 32 * h)), shifts);
      c[h] = _mm256_or_si256(c[h], _mm256_slli_epi32(_mm256_and_si256(bits, mask), At));
    }
  }

  // Step i of a group: 4 k (kk .. kk + 3 of super-block sb) as the unsigned operand u and, for signed codes, the
  // codes themselves, whose signs x takes.
  struct Step {
    __m256i u[2], s[2];
  };
  static inline Step step(const uint8_t* sb, int64_t kk) {
    const __m256i transpose = load(kTranspose.data());
    __m256i c[2];
    if constexpr (B::kWholeBytes) {  // rows k, k + 1 | k + 2, k + 3: 32-bit lanes of 4 columns, gathered by k
      const __m256i a = load(sb + kk * P), z = load(sb + (kk + 2) * P);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      c[0] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(_mm256_unpacklo_epi32(a, z), order), transpose);
      c[1] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(_mm256_unpackhi_epi32(a, z), order), transpose);
    } else {
      c[0] = c[1] = _mm256_setzero_si256();
      if constexpr (Lay::kLow > 0) {  // byte j of each k's 8: columns j and j + 8, one per nibble
        const __m256i z = _mm256_permutevar8x32_epi32(load(sb + kk * W), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        const __m256i t = _mm256_shuffle_epi8(z, transpose), low = _mm256_set1_epi8(0x0F);
        c[0] = _mm256_and_si256(t, low);
        c[1] = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
      }
      const uint8_t* fields = sb + Tr::kBlock * B::kLowBytes;
      if constexpr (Tr::kHigh > 0) add_field<Tr::kHigh, Lay::kLow>(fields + kk * B::kHighBytes, kHighBytes, c);
      if constexpr (Lay::kTop > 0)
        add_field<Lay::kTop, Lay::kLow + Tr::kHigh>(fields + Tr::kBlock * B::kHighBytes + kk * B::kTopBytes,
                                                    kTopBytes, c);
      if constexpr (Lay::kLookup) {
        const __m256i table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTableBytes.data())));
        c[0] = _mm256_shuffle_epi8(table, c[0]);
        c[1] = _mm256_shuffle_epi8(table, c[1]);
      }
    }
    Step st;
    for (int h = 0; h < 2; ++h) {
      st.u[h] = kSigned ? _mm256_abs_epi8(c[h]) : c[h];
      st.s[h] = c[h];
    }
    return st;
  }

  // out[r] = the group's sums for R rows, step i's codes from at(i).
  template <int R, class Get>
  static inline void rows(Get&& at, const int8_t* x, int64_t ldx, int32_t (*out)[P]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int c0 = 0; c0 < kSteps; c0 += kChunk) {
      __m256i sum[R][2];
      for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
      for (int i = c0; i < c0 + kChunk; ++i) {
        const Step& st = at(i);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, x + r * ldx + 4 * i, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          for (int h = 0; h < 2; ++h)
            sum[r][h] = _mm256_add_epi16(
                sum[r][h], _mm256_maddubs_epi16(st.u[h], kSigned ? _mm256_sign_epi8(xv, st.s[h]) : xv));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(sum[r][h], ones));
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r]), acc[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + W), acc[r][1]);
    }
  }

  // How far ahead (in k) the weights are prefetched: a memory latency's worth of this row count's work.
  template <int R>
  static constexpr int64_t kAhead = R <= 2 ? 256 : 64;

  template <int R>
  inline void dots(int64_t p, int64_t g, const int8_t* x, int64_t ldx, int32_t (*out)[P]) const {
    const uint8_t* sb = b.w + (p * b.nsb + g / B::kGroups) * B::kBytes + B::kMeta;
    const int64_t kk0 = g % B::kGroups * Tr::kGroup;
    // Every line of the group's share of the panel, kAhead k ahead.
    constexpr int64_t kGroupBytes = (Tr::kGroup * B::kBytes + Tr::kBlock - 1) / Tr::kBlock;
    const uint8_t* ahead = b.w + p * b.nsb * B::kBytes + (g * Tr::kGroup + kAhead<R>) * B::kBytes / Tr::kBlock;
    for (int64_t o = 0; o < kGroupBytes; o += 64) __builtin_prefetch(ahead + o, 0, 3);
    if constexpr (R <= 2) {  // decode inside the rows' loop: codes, sums and x all in registers
      rows<R>([&](int i) { return step(sb, kk0 + 4 * i); }, x, ldx, out);
    } else {  // decode once, then two rows at a time over the decoded steps
      Step st[kSteps];
      for (int i = 0; i < kSteps; ++i) st[i] = step(sb, kk0 + 4 * i);
      auto at = [&](int i) -> const Step& { return st[i]; };
      for (int r = 0; r + 1 < R; r += 2) rows<2>(at, x + r * ldx, ldx, out + r);
      if constexpr (R % 2) rows<1>(at, x + (R - 1) * ldx, ldx, out + R - 1);
    }
  }
};
#endif

// fn(micro-kernel of type T over `data`) with the fastest micro-kernel this build has for it.
template <int64_t T, typename Fn>
inline void with_dots(const uint8_t* data, int64_t k, Fn&& fn) {
#if defined(PAGODA_GGUF_AVX2_DOTS)
  fn(Avx2Dots<T>(data, k));
#else
  fn(RefDots<T>(data, k));
#endif
}

}  // namespace pagoda_gguf
