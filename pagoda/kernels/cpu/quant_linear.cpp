// y = x @ dequant(w)^T (+ bias) for quantized weights, streaming the packed weight once per few rows of x.
//
// Decode is bound by weight bytes read per token, so the weight stays packed in memory and is
// unpacked in registers. Formats, all with per-(row, group) fp32 scale s and offset o so that
// w = code * s + o (o = 0 for the symmetric ones; o = -s * zero for INT4):
//   int4: codes 0..15 packed two per byte [N, K/2], low nibble = even k (pagoda int4_format)
//   int8: int8 codes [N, K] (per-channel: group = K; GGUF Q8_0: group = 32)
//   fp8:  float8 e4m3fn bytes [N, K], per-channel scale
//   int4x8: int4 codes in blocks of 8 rows [N/8, 4K], scales/offsets [N/8, G, 8] (int4x8_i8.h: VNNI, AVX2 or Arm sdot)
//   int4a8: int4 codes as int4 (rows_int4_a8, AVX2: the shapes int4x8 cannot take)
//   the two formats that quantize activations (to int8 per 32 columns), chosen by the user
//
// The row-major kernel (`rows`) is portable vector code (simd.h): the same source is the AVX-512, AVX2 and NEON
// build. Per 2W columns of a weight row it decodes the codes into two fp32 vectors, makes them weights with one
// FMA each (code * s + o), and FMAs them into one chain per (weight row, activation row); a chain's W lanes are
// summed in one tree at the end. That order depends on K and the format only, never on the row count (batch
// invariance): the row count only decides how many activation rows share a decode, how many weight rows run
// together, and whether a block of weight rows is dequantized once into a tile that stays in cache (more rows
// than one pass takes: the same weights, loaded instead of decoded again).
// ISA-specific kernels where they measurably pay: INT4 with bf16 activations on AVX512-BF16 (rows_int4_bf16),
// INT4 with INT8 activations on AVX512-VNNI, AVX2 and Arm's sdot (int4x8_i8.h; rows_int4_a8 for other shapes). With
// bf16 or fp32 activations the panel kernels (quant_panel_linear.cpp with AVX512-BF16, else the portable
// quant_vpanel_linear.cpp) take every shape they can; these take the rest.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "dispatch_rows.h"
#include "int4x8_i8.h"
#include "linear_formats.h"
#include "ops.h"
#include "quant_decode.h"
#include "simd.h"
#include "vec_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_QUANT_AVX512 1
#endif

namespace {

constexpr int64_t kChunkM = 8;
using Fmt = pagoda_cpu::LinearFormat;  // kInt4, kInt8, kFp8 and kInt4x8 (linear_formats.h)
using pagoda_cpu::kFp8;
using pagoda_cpu::kInt4;
using pagoda_cpu::kInt4a8;
using pagoda_cpu::kInt4x8;
using pagoda_cpu::kInt8;

using pagoda_simd::hsum;
using pagoda_simd::vf;
using pagoda_simd::vfma;
using pagoda_simd::vload;
using pagoda_simd::vsplat;
using pagoda_simd::vstore;
using pagoda_simd::W;

// Activation rows that share one decode of the weights: two chains per row plus the two weight vectors and an
// activation load must fit the register file (16 vectors on AVX2 and NEON, 32 on AVX-512).
constexpr int64_t kRowsPerPass = W == 16 ? 8 : 4;
constexpr int64_t kTileRows = 16;  // weight rows per dequantized tile (16 x K fp32: in L2 for K up to ~8k)

// The codes of 2W weights from weight column k (k % 2W == 0) of one row, as fp32 values: a, b. INT4 gives the
// even columns in a and the odd ones in b (low and high nibbles): x is prepared to match (split_even_odd).
template <int F>
inline void decode(const uint8_t* row, int64_t k, vf& a, vf& b) {
  pagoda_simd::decode_codes<F>(row + (F == kInt4 ? k / 2 : k), a, b);
}

// Where `rows` gets a weight row's 2W weights at column k (group g), as fp32: decoded from the packed codes and
// scaled in registers (w = code * s + o, one rounding), or the same values loaded from a tile they were dequantized
// into once (fill_tile) for every pass of activation rows over it.
template <int F>
struct CodeRows {
  const uint8_t* w;
  int64_t row_bytes;
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G] or null
  int64_t G;
  int64_t prefetch_rows;  // how far ahead rows are prefetched: the hardware prefetcher alone leaves the loop waiting

  inline void load(int64_t n, int64_t g, int64_t k, vf& a, vf& b) const {
    const uint8_t* row = w + n * row_bytes;
    if (prefetch_rows) __builtin_prefetch(row + prefetch_rows * row_bytes + (F == kInt4 ? k / 2 : k), 0, 3);
    decode<F>(row, k, a, b);
    const vf s = vsplat(scales[n * G + g]), o = vsplat(offsets ? offsets[n * G + g] : 0.f);
    a = vfma(a, s, o);
    b = vfma(b, s, o);
  }
};

struct TileRows {
  const float* tile;  // rows [n0, n0 + kTileRows) x K, each 2W columns as `decode` orders them
  int64_t n0, K;

  inline void load(int64_t n, int64_t, int64_t k, vf& a, vf& b) const {
    const float* p = tile + (n - n0) * K + k;
    a = vload(p);
    b = vload(p + W);
  }
};

template <int F>
void fill_tile(const CodeRows<F>& src, float* tile, int64_t K, int64_t gs, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < K; k += 2 * W) {
      vf a, b;
      src.load(n, k / gs, k, a, b);
      vstore(tile + (n - n0) * K + k, a);
      vstore(tile + (n - n0) * K + k + W, b);
    }
}

// Output rows [n0, n1) for M activation rows (xd: prepared by split_even_odd, [M, K]), R weight rows at a time.
// Each (weight row, activation row) is one chain of FMAs over k, W lanes wide, summed in one tree at the end.
template <int M, int R, typename Src, typename O>
void rows(const Src& src, const float* bias, const float* xd, O* y, int64_t ldy, int64_t K, int64_t gs, int64_t n0,
          int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    vf acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = vf{};
    for (int64_t k = 0; k < K; k += 2 * W) {
      vf a[R], b[R];  // every weight row's vectors first, so each activation vector is loaded once
      for (int r = 0; r < R; ++r) src.load(n + r, k / gs, k, a[r], b[r]);
      for (int m = 0; m < M; ++m) {
        const vf xa = vload(xd + m * K + k), xb = vload(xd + m * K + k + W);
        for (int r = 0; r < R; ++r) acc[r][m] = vfma(b[r], xb, vfma(a[r], xa, acc[r][m]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float bv = bias ? bias[n + r] : 0.f;
      for (int m = 0; m < M; ++m) y[m * ldy + n + r] = static_cast<O>(hsum(acc[r][m]) + bv);
    }
  }
  if constexpr (R > 1) {
    if (n < n1) rows<M, 1>(src, bias, xd, y, ldy, K, gs, n, n1);
  }
}

// x [M, K] as fp32 with each 2W columns split [even | odd] for INT4 (the nibbles' order); as it is otherwise (no copy
// where x is already contiguous fp32).
at::Tensor split_even_odd(const at::Tensor& x, int64_t fmt) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if (fmt != kInt4) return xf;
  const int64_t M = xf.size(0), K = xf.size(1);
  at::Tensor xd = at::empty({M, K}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* d = xd.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 2 * W)
      for (int j = 0; j < W; ++j) {
        d[m * K + k + j] = src[m * K + k + 2 * j];
        d[m * K + k + W + j] = src[m * K + k + 2 * j + 1];
      }
  return xd;
}

// The row-major kernel over all of y: blocks of weight rows in parallel. Up to one pass of rows, each decodes the
// weights it streams (several weight rows at a time: independent chains, one activation load for all); more rows
// dequantize each block of weight rows into a tile once and run every pass of kRowsPerPass rows over it, two
// weight rows at a time (2 x kRowsPerPass accumulators, 4 weight and 2 activation vectors: 14 of AVX2's 16
// registers; 22 of AVX-512's 32).
template <int F, typename O>
void run(const CodeRows<F>& src, const float* xd, const float* bias, O* y, int64_t M, int64_t N, int64_t K,
         int64_t gs) {
  if (M <= kRowsPerPass) {
    at::parallel_for(0, N, 64, [&](int64_t b0, int64_t b1) {
      dispatch_m(M, [&](auto c) {
        constexpr int Mc = decltype(c)::value, R = Mc <= 2 ? 4 : 2;
        rows<Mc, R>(src, bias, xd, y, N, K, gs, b0, b1);
      });
    });
    return;
  }
  at::parallel_for(0, (N + kTileRows - 1) / kTileRows, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tile(kTileRows * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, n1 = std::min(N, n0 + kTileRows);
      fill_tile(src, tile.data(), K, gs, n0, n1);
      const TileRows tiled{tile.data(), n0, K};
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
        dispatch_m(std::min(kRowsPerPass, M - m0), [&](auto c) {
          rows<decltype(c)::value, 2>(tiled, bias, xd + m0 * K, y + m0 * N, N, K, gs, n0, n1);
        });
    }
  });
}

// Dequantize rows [n0, n1) to O (float or c10::BFloat16) in k order: the values `rows` computes with.
// IL: INT4 in the 8-row interleaved layout (see blocks_int4x8_i8), each row gathered back first.
template <int F, typename O, bool IL = false>
void dequant_rows(const uint8_t* w, int64_t row_bytes, const float* scales, const float* offsets, O* out,
                  int64_t K, int64_t G, int64_t gs, int64_t n0, int64_t n1) {
  std::vector<uint8_t> row(IL ? row_bytes : 0);
  std::vector<float> rs(IL ? G : 0), ro(IL && offsets ? G : 0);
  float a_[W], b_[W];
  for (int64_t n = n0; n < n1; ++n) {
    CodeRows<F> src{w, row_bytes, scales, offsets, G, 0};
    int64_t at_n = n;
    if constexpr (IL) {  // one row with its scales, from its block of 8
      const int64_t b = n / 8, j = n % 8;
      for (int64_t c = 0; c < row_bytes / 32; ++c)
        for (int t = 0; t < 8; ++t)
          std::memcpy(row.data() + 32 * c + 4 * t, w + b * 8 * row_bytes + 256 * c + 32 * t + 4 * j, 4);
      for (int64_t g = 0; g < G; ++g) {
        rs[g] = scales[(b * G + g) * 8 + j];
        if (offsets) ro[g] = offsets[(b * G + g) * 8 + j];
      }
      src = CodeRows<F>{row.data(), row_bytes, rs.data(), offsets ? ro.data() : nullptr, G, 0};
      at_n = 0;
    }
    O* orow = out + n * K;
    for (int64_t k = 0; k < K; k += 2 * W) {
      vf a, b;
      src.load(at_n, k / gs, k, a, b);
      vstore(a_, a);
      vstore(b_, b);
      for (int j = 0; j < W; ++j) {
        if constexpr (F == kInt4) {  // a: even columns, b: odd ones
          orow[k + 2 * j] = static_cast<O>(a_[j]);
          orow[k + 2 * j + 1] = static_cast<O>(b_[j]);
        } else {
          orow[k + j] = static_cast<O>(a_[j]);
          orow[k + W + j] = static_cast<O>(b_[j]);
        }
      }
    }
  }
}

// Blocks of weight rows in parallel; within a block every 8-row chunk of x reuses the cached rows.
template <typename Rows>
void run_blocks(int64_t M, int64_t N, Rows&& rows_fn) {
  // Small M: ~64 weight rows per task keeps both threads streaming. Large M: blocks of 16 rows are
  // revisited by every 8-row chunk of x while they sit in cache.
  const int64_t grain = M <= kChunkM ? 64 : 16;
  at::parallel_for(0, N, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t n0 = b0; n0 < b1; n0 += grain) {
      const int64_t n1 = std::min(b1, n0 + grain);
      for (int64_t m0 = 0; m0 < M; m0 += kChunkM) rows_fn(m0, std::min(kChunkM, M - m0), n0, n1);
    }
  });
}

// x quantized to int8 per row and 32 columns, as llama.cpp's Q8 blocks are: scale a = max|x| / 127 (xa [M, K / 32]),
// round to nearest; each `chunk` columns (32 or 64: the kernel's nibble order) stored [even | odd]. xs: exact fp32
// sums of x per group of gs columns, for the offsets. On x86 vectorized and over the threads (at many rows quantizing
// x is part of the INT8 kernel's cost); elsewhere the scalar loop, which is the definition both follow.
struct QuantizedX {
  std::vector<int8_t> xq;
  std::vector<float> xa, xs;
};

QuantizedX quantize_x_i8(const at::Tensor& x, int64_t chunk, int64_t gs) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* src = xf.data_ptr<float>();
  const int64_t M = xf.size(0), K = xf.size(1);
  QuantizedX q{std::vector<int8_t>(M * K), std::vector<float>(M * K / 32), pagoda_simd::group_sums(src, M, K, gs)};
#if defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = src + m * K;
      float* a = q.xa.data() + m * K / 32;
      int8_t* d = q.xq.data() + m * K;
      for (int64_t k = 0; k < K; k += 32) {
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(r + k + 8 * i);
          mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float sa = _mm_cvtss_f32(h) / 127.f;
        a[k / 32] = sa;
        const __m256 inv = _mm256_set1_ps(sa > 0.f ? 1.f / sa : 0.f);
        __m256i c[4];  // round to nearest even (MXCSR's default), as std::nearbyint
        for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        b = _mm256_permutevar8x32_epi32(b, in_order);                        // columns k..k+31 in order
        b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, even_odd), 0xD8);  // [16 even | 16 odd]
        if (chunk == 32) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k), b);
        } else {  // this block's half of its 64-column chunk's even and odd runs
          int8_t* c0 = d + k - k % 64 + (k % 64) / 2;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(c0), _mm256_castsi256_si128(b));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(c0 + 32), _mm256_extracti128_si256(b, 1));
        }
      }
    }
  });
#else
  for (int64_t m = 0; m < M; ++m) {
    const float* r = src + m * K;
    float* a = q.xa.data() + m * K / 32;
    for (int64_t k = 0; k < K; k += 32) {
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(r[k + j]));
      a[k / 32] = amax / 127.f;
    }
    int8_t* d = q.xq.data() + m * K;
    for (int64_t k = 0; k < K; k += chunk)
      for (int64_t j = 0; j < chunk / 2; ++j) {
        const float sa = a[(k + 2 * j) / 32];  // columns 2j and 2j + 1 share a 32-column block
        const float inv = sa > 0.f ? 1.f / sa : 0.f;
        d[k + j] = static_cast<int8_t>(std::nearbyint(r[k + 2 * j] * inv));
        d[k + chunk / 2 + j] = static_cast<int8_t>(std::nearbyint(r[k + 2 * j + 1] * inv));
      }
  }
#endif
  return q;
}

#if defined(__AVX2__) && defined(__FMA__)
// INT4 weights (row-major, as kInt4) times INT8 activations on AVX2 (fmt kInt4a8): what the shapes int4x8 cannot
// take (rows not in blocks of 8, K not a multiple of 64) run for quant_activations="int8", llama.cpp's Q4 x Q8. Per
// 32 columns a row's 16 bytes become 32 codes [low nibbles | high nibbles] = [even | odd columns], matching x's
// [even | odd] int8 block; vpmaddubsw multiplies unsigned codes by signed activations into 16-bit pairs (|sum| <=
// 2 * 15 * 127: no saturation), vpmaddwd sums pairs to 8 int32, and one FMA adds them scaled by s * a. One chain per
// (weight row, activation row), summed in a fixed order at the end whatever the row count (batch invariance); four
// weight rows at a time at one row.
using pagoda_simd::hsum8;

template <int M, int R, typename O>
void rows_int4_a8(const uint8_t* w, int64_t row_bytes, const float* scales, const float* offsets, const float* bias,
                  const QuantizedX& q, int64_t m0, O* y, int64_t ldy, int64_t K, int64_t G, int64_t gs, int64_t n0,
                  int64_t n1) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xq = q.xq.data() + m0 * K;
  const float* xa = q.xa.data() + m0 * K / 32;
  const float* xs = q.xs.data() + m0 * G;
  const int64_t ahead = std::max<int64_t>(R, 4096 / row_bytes);  // rows ~4 KiB ahead, into L1
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = w + (n + r) * row_bytes + k / 2;
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead * row_bytes), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib);
        const float s = scales[(n + r) * G + k / gs];
        for (int m = 0; m < M; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), ones);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * xa[m * K / 32 + k / 32]), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float bv = bias ? bias[n + r] : 0.f;
      for (int m = 0; m < M; ++m) {
        float off = 0.f;
        if (offsets)
          for (int64_t g = 0; g < G; ++g) off += offsets[(n + r) * G + g] * xs[m * G + g];
        y[m * ldy + n + r] = static_cast<O>(hsum8(acc[r][m]) + off + bv);
      }
    }
  }
  if constexpr (R > 1) {
    if (n < n1) rows_int4_a8<M, 1, O>(w, row_bytes, scales, offsets, bias, q, m0, y, ldy, K, G, gs, n, n1);
  }
}
#define PAGODA_INT4_A8 1
#endif

bool quant_linear_supported(int64_t K, int64_t group_size) {
  return K % 32 == 0 && group_size % 32 == 0 && K % group_size == 0;  // 2W columns a step (W <= 16)
}

bool int4a8_supported(int64_t K, int64_t group_size) {
#if defined(PAGODA_INT4_A8)
  return quant_linear_supported(K, group_size);
#else
  (void)K;
  (void)group_size;
  return false;
#endif
}

#if defined(PAGODA_QUANT_AVX512)
#if defined(__AVX512BF16__)
// INT4 with bf16 activations: a code q becomes the bf16 number 128 + q with one OR (0x4300 | q: the
// exponent of 128 leaves exactly 7 mantissa bits for q), and is dotted with AVX512-BF16 (32 products
// per instruction, fp32 accumulation; (128 + q) * x is exact in fp32). The 128 * sum(x) it adds per
// group comes off with the offset term. Half the instructions of the fp32 path per weight, and no
// cross-lane table lookup. xb holds x as bf16 with each 64-column chunk split into [even | odd] columns,
// matching the low/high nibbles of its 32 bytes. For 32-wide groups a chunk spans two groups: fp32
// lanes 0..7 of the dot products belong to the first, 8..15 to the second.
// R weight rows go through together: their dot-product chains are independent (at M = 1 one row's
// chain is latency-bound) and share each activation load.
template <int M, int R>
void rows_int4_bf16(const uint8_t* w, int64_t row_bytes, const float* scales, const float* offsets,
                    const float* bias, const uint16_t* xb, const float* xs, c10::BFloat16* y, int64_t ldy, int64_t K,
                    int64_t G, int64_t gs, int64_t n0, int64_t n1) {
  const __m512i nib = _mm512_set1_epi16(0xF);
  const __m512i b128 = _mm512_set1_epi16(0x4300);  // bf16 bits of 128.0
  const __m512 m128 = _mm512_set1_ps(-128.f);
  const int64_t prefetch_rows = R + std::max<int64_t>(R, 4096 / row_bytes);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    // The rows ~4 KiB ahead, into L1 while these compute: the hardware prefetcher alone leaves this
    // loop waiting on memory. The distance is not critical; a page ahead is enough.
    const uint8_t* ahead[R];
    for (int r = 0; r < R; ++r) ahead[r] = w + std::min(n + r + prefetch_rows, n1 - 1) * row_bytes;
    auto chunk = [&](int64_t k, __m512 (&gacc)[R][M]) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead[r] + k / 2), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + r) * row_bytes + k / 2)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(v, nib, b128, 0xEA);  // (v & nib) | b128
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), b128);
        for (int m = 0; m < M; ++m) {
          gacc[r][m] = _mm512_dpbf16_ps(gacc[r][m], lo, (__m512bh)_mm512_loadu_si512(xb + m * K + k));
          gacc[r][m] = _mm512_dpbf16_ps(gacc[r][m], hi, (__m512bh)_mm512_loadu_si512(xb + m * K + k + 32));
        }
      }
    };
    auto scale_into_acc = [&](const __m512 (&gacc)[R][M], auto scale_of_row) {
      for (int r = 0; r < R; ++r) {
        const __m512 s = scale_of_row(scales + (n + r) * G);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(gacc[r][m], s, acc[r][m]);
      }
    };
    if (gs == 32) {
      for (int64_t k = 0; k < K; k += 64) {
        __m512 gacc[R][M];
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < M; ++m) gacc[r][m] = _mm512_setzero_ps();
        chunk(k, gacc);
        const int64_t g = k / 32;
        scale_into_acc(gacc, [&](const float* sr) {
          return _mm512_insertf32x8(_mm512_set1_ps(sr[g]), _mm256_set1_ps(sr[g + 1]), 1);
        });
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        __m512 gacc[R][M];
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < M; ++m) gacc[r][m] = _mm512_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) chunk(k, gacc);
        scale_into_acc(gacc, [&](const float* sr) { return _mm512_set1_ps(sr[g]); });
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* sr = scales + (n + r) * G;
      // sum_g (offset[n, g] - 128 * scale[n, g]) * sum(x over g), 16 groups per vector, into the same accumulators
      for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const __mmask16 mk = G - g0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (G - g0)) - 1);
        __m512 ov = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sr + g0), m128);
        if (offsets) ov = _mm512_add_ps(ov, _mm512_maskz_loadu_ps(mk, offsets + (n + r) * G + g0));
        for (int m = 0; m < M; ++m)
          acc[r][m] = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(mk, xs + m * G + g0), acc[r][m]);
      }
      const float bv = bias ? bias[n + r] : 0.f;
      for (int m = 0; m < M; ++m)
        y[m * ldy + n + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][m]) + bv);
    }
  }
  if constexpr (R > 1) {
    if (n < n1) rows_int4_bf16<M, 1>(w, row_bytes, scales, offsets, bias, xb, xs, y, ldy, K, G, gs, n, n1);
  }
}
#endif
#endif

bool int4x8_supported(int64_t K, int64_t group_size) {
#if defined(PAGODA_INT4X8_I8)
  return K % 64 == 0 && quant_linear_supported(K, group_size);
#else
  (void)K;
  (void)group_size;
  return false;
#endif
}

// x: [M, K] fp32 or bf16; y: [M, N] in x's dtype (fp32 accumulation). fmt: 0 int4, 1 int8, 2 fp8 (see header). scales/offsets: fp32 [N, K / group_size].
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                        int64_t fmt, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar),
              "quant_linear: x [M, K], w uint8/int8 [N, bytes]");
  TORCH_CHECK(fmt >= kInt4 && fmt <= kInt4a8, "quant_linear: unknown format");
  // int4x8 (kInt4x8) stores blocks of 8 rows: w [N / 8, 8 * K / 2].
  const int64_t M = x.size(0), K = x.size(1), N = fmt == kInt4x8 ? 8 * w.size(0) : w.size(0);
  TORCH_CHECK(quant_linear_supported(K, group_size), "quant_linear: unsupported K/group size");
  TORCH_CHECK(fmt != kInt4x8 || int4x8_supported(K, group_size), "quant_linear: int4x8 needs AVX2 or Arm's "
              "dot products, K a multiple of 64 and of the group size");
  const int64_t row_bytes = fmt == kInt4 || fmt == kInt4a8 ? K / 2 : K;
  const int64_t G = K / group_size;
  TORCH_CHECK(fmt != kInt4a8 || int4a8_supported(K, group_size), "quant_linear: int4a8 needs AVX2");
  TORCH_CHECK(w.size(1) == (fmt == kInt4x8 ? 4 * K : row_bytes) && w.is_contiguous(), "quant_linear: weight shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * G,
              "quant_linear: scales fp32 [N, G]");
  if (offsets.has_value())
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->numel() == N * G,
                "quant_linear: offsets fp32 [N, G]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias fp32 [N]");
  // Written in x's dtype by the kernels (one rounding of the fp32 sum).
  auto y = at::empty({M, N}, x.options());
#if defined(PAGODA_INT4X8_I8)
  if (fmt == kInt4x8) {
    const QuantizedX q = quantize_x_i8(x, 64, group_size);  // each 64-column chunk [even | odd]
    const auto* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    auto go = [&](auto* yp) {
      using O = std::remove_pointer_t<decltype(yp)>;
      // Blocks of 8 weight rows in parallel; within a task every kRows-row chunk of x reuses them from cache.
      constexpr int64_t kRows = pagoda_i8::kRows;
      at::parallel_for(0, N / 8, M <= kRows ? 8 : 2, [&](int64_t p0, int64_t p1) {
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          dispatch_m(std::min(kRows, M - m0), [&](auto c) {
            constexpr int Mc = decltype(c)::value, R = Mc == 1 ? 2 : 1;  // two blocks in flight at M = 1
            pagoda_i8::blocks_int4x8_i8<Mc, R, O>(wp, sp, op, bp, q.xq.data() + m0 * K, q.xa.data() + m0 * K / 32,
                                       q.xs.data() + m0 * G, yp + m0 * N, N, K, G, group_size, p0, p1);
          });
      });
    };
    if (x.scalar_type() == at::kFloat) go(y.data_ptr<float>());
    else if (x.scalar_type() == at::kBFloat16) go(y.data_ptr<c10::BFloat16>());
    else TORCH_CHECK(false, "quant_linear: x must be float32 or bfloat16");
    return y;
  }
#endif
#if defined(PAGODA_QUANT_AVX512)
#if defined(__AVX512BF16__)
  if (fmt == kInt4 && x.scalar_type() == at::kBFloat16 && K % 64 == 0) {
    const at::Tensor xc = x.contiguous();
    const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    std::vector<uint16_t> xb(M * K);
    std::vector<float> xs(M * G, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* r = src + m * K;
      uint16_t* d = xb.data() + m * K;
      for (int64_t k = 0; k < K; k += 64)
        for (int j = 0; j < 32; ++j) { d[k + j] = r[k + 2 * j]; d[k + 32 + j] = r[k + 2 * j + 1]; }
      for (int64_t k = 0; k < K; ++k)  // group sums, for the offset and the 128 bias
        xs[m * G + k / group_size] += static_cast<float>(c10::BFloat16(r[k], c10::BFloat16::from_bits()));
    }
    const auto* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    auto* yp = y.data_ptr<c10::BFloat16>();
    run_blocks(M, N, [&](int64_t m0, int64_t mc, int64_t n0, int64_t n1) {
      dispatch_m(mc, [&](auto c) {
        // Four weight rows per pass at M = 1 (at M >= 2 the rows already give independent chains).
        constexpr int Mc = decltype(c)::value, R = Mc == 1 ? 4 : 1;
        rows_int4_bf16<Mc, R>(wp, row_bytes, sp, op, bp, xb.data() + m0 * K, xs.data() + m0 * G, yp + m0 * N, N, K,
                              G, group_size, n0, n1);
      });
    });
    return y;
  }
#endif
#endif
#if defined(PAGODA_INT4_A8)
  if (fmt == kInt4a8) {
    const QuantizedX q = quantize_x_i8(x, 32, group_size);  // each 32 columns [even | odd]: the nibbles' order
    const auto* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
    const float* sp = scales.data_ptr<float>();
    const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    auto go = [&](auto* yp) {
      using O = std::remove_pointer_t<decltype(yp)>;
      run_blocks(M, N, [&](int64_t m0, int64_t mc, int64_t n0, int64_t n1) {
        dispatch_m(mc, [&](auto c) {
          constexpr int Mc = decltype(c)::value, R = Mc == 1 ? 4 : Mc == 2 ? 2 : 1;
          rows_int4_a8<Mc, R, O>(wp, row_bytes, sp, op, bp, q, m0, yp + m0 * N, N, K, G, group_size, n0, n1);
        });
      });
    };
    if (x.scalar_type() == at::kFloat) go(y.data_ptr<float>());
    else if (x.scalar_type() == at::kBFloat16) go(y.data_ptr<c10::BFloat16>());
    else TORCH_CHECK(false, "quant_linear: x must be float32 or bfloat16");
    return y;
  }
#endif
  // The portable kernel: fp32 activations (bf16 ones widened), output in x's dtype.
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  TORCH_CHECK(fmt != kInt4x8 && fmt != kInt4a8, "quant_linear: INT8-activation weights need their kernel");
  const at::Tensor xd = split_even_odd(x, fmt);
  const auto* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t ahead = std::max<int64_t>(4, 4096 / row_bytes);  // rows ~4 KiB ahead
  auto go = [&](auto* yp) {
    pagoda_simd::dispatch_codes(fmt, [&](auto f) {
      constexpr int F = decltype(f)::value;
      run<F>(CodeRows<F>{wp, row_bytes, sp, op, G, ahead}, xd.data_ptr<float>(), bp, yp, M, N, K, group_size);
    });
  };
  if (x.scalar_type() == at::kFloat) go(y.data_ptr<float>());
  else go(y.data_ptr<c10::BFloat16>());
  return y;
}

// The float weight [N, K] in `dtype` (float32 or bfloat16), as PackedWeight.dequantize computes it, rounded once to
// dtype: for paths that multiply by the dequantized weight (the MoE experts above a linear's row limit,
// benchmarks.quant_kernels). No layer uses it since every row count runs the kernels above (batch invariance).
at::Tensor quant_dequantize(const at::Tensor& w, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                            int64_t fmt, int64_t group_size, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(fmt >= kInt4 && fmt <= kInt4a8, "quant_dequantize: unknown format");
  if (fmt == kInt4a8) fmt = kInt4;  // the same codes; only the activations differ
  TORCH_CHECK(quant_linear_supported(K, group_size), "quant_dequantize: unsupported K/group size");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: dtype must be float32 or bfloat16");
  const bool il = fmt == kInt4x8;  // int4x8: w [N / 8, 8 * K / 2]
  const int64_t N = il ? 8 * w.size(0) : w.size(0), G = K / group_size, row_bytes = fmt == kInt4 || il ? K / 2 : K;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == (il ? 8 : 1) * row_bytes && w.is_contiguous(), "quant_dequantize: weight shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * G,
              "quant_dequantize: scales fp32 [N, G]");
  if (offsets.has_value())
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->numel() == N * G,
                "quant_dequantize: offsets fp32 [N, G]");
  auto out = at::empty({N, K}, w.options().dtype(dtype));
  const auto* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  auto go = [&](auto* outp) {
    using O = std::remove_pointer_t<decltype(outp)>;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (fmt == kInt4) dequant_rows<kInt4, O>(wp, row_bytes, sp, op, outp, K, G, group_size, n0, n1);
      else if (il) dequant_rows<kInt4, O, true>(wp, row_bytes, sp, op, outp, K, G, group_size, n0, n1);
      else if (fmt == kInt8) dequant_rows<kInt8, O>(wp, row_bytes, sp, op, outp, K, G, group_size, n0, n1);
      else dequant_rows<kFp8, O>(wp, row_bytes, sp, op, outp, K, G, group_size, n0, n1);
    });
  };
  if (dtype == at::kFloat) go(out.data_ptr<float>());
  else go(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

namespace pagoda_cpu {
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t fmt,
                        int64_t group_size) {
  return ::quant_linear(x, w, scales, offsets, bias, fmt, group_size);
}
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("quant_linear(Tensor x, Tensor w, Tensor scales, Tensor? offsets, Tensor? bias, int fmt, int group_size) "
        "-> Tensor");
  m.def("int4x8_supported(int K, int group_size) -> bool", &int4x8_supported);  // no tensors: no dispatch key
  m.def("int4a8_supported(int K, int group_size) -> bool", &int4a8_supported);
  m.def("quant_linear_supported(int K, int group_size) -> bool", &quant_linear_supported);  // no tensors
  m.def("quant_dequantize(Tensor w, Tensor scales, Tensor? offsets, int fmt, int group_size, int K, ScalarType dtype) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
