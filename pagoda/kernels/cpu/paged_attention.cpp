// Paged attention for CPU: causal, varlen (mixed decode / chunked prefill), GQA, with an optional
// sliding window (a query at p sees keys (p - window, p]) and logit soft-capping (Gemma 2: s = c tanh(s / c)).
//
// Work item = (sequence, kv head, tile of queries). The rows of a tile are all
// (query, query-head) pairs of one GQA group, so every K/V block is read once per
// group. Keys are processed in chunks of KC keys gathered through the block table;
// scores use an online (flash-attention style) softmax in fp32.
//
// A bf16 cache with K stored as words (with AVX512-BF16) is multiplied by bf16 dot products (vdpbf16ps,
// fp32 sums): scores straight from the K words, and P rounded to bf16 times V rows, both read in place.
// fp32, 8-bit and row-major bf16 caches stage each chunk in fp32 and use fp32 FMAs.
//
// A draft-tree query (speculative decoding: a tree-mask word) reads the keys it sees as one sequence: those up to
// the first one its word hides where they are, then the ones it keeps, in order (its ancestors, then itself). Its
// chunks then hold what decoding its path alone would put there, at the same offsets, so every sum (lanes, bf16 key
// pairs, chunk maxima) is the same: a tree verifies with plain decoding's bits. A tile of tree queries reads the
// chunks their views share once for all of them, and the rest once per query, gathered.
//
// Only light ATen headers are included: <torch/extension.h> costs several times their
// compile time. The op is registered through TORCH_LIBRARY (no
// pybind11) and called from Python as torch.ops.pagoda.paged_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec_bf16.h"

namespace {

// Portable SIMD (simd.h): W floats per vector.
using pagoda_simd::hmax;
using pagoda_simd::hsum;
using pagoda_simd::transpose_block;
using pagoda_simd::vf;
using pagoda_simd::vi;
using pagoda_simd::vload;
using pagoda_simd::vstore;
using pagoda_simd::W;

constexpr int KC = 2 * W;   // keys per chunk (two vectors of scores per row)
// Rows per micro-kernel call (register blocking): a tile's 2 RB accumulators, two K or V vectors and a
// broadcast fit the ISA's vector registers (AVX2 has 16, AVX-512 and NEON 32; 8 rows on AVX2 spilled).
constexpr int RB = W == 8 ? 6 : 8;
constexpr int TARGET_ROWS = 32;  // rows (queries x group heads) per work item

// exp(x) for x <= 0 (arguments are already max-subtracted), exactly 0 below -87 (where simd.h's vexp clamps):
// a masked key's -inf adds nothing to a row.
inline vf vexp_masked(vf x) {
  const vi dead = x < -87.f;
  return dead ? vf{} : pagoda_simd::vexp(x);
}

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }

// 8-bit cache elements (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2): each gathered row is
// dequantized into the fp32 chunk scratch, value = decode(byte) * the row's scale. Tags over the byte.
struct I8 { int8_t x; };
struct E4M3 { uint8_t x; };
struct E5M2 { uint8_t x; };
template <typename C>
constexpr bool kQuantized = std::is_same<C, I8>::value || std::is_same<C, E4M3>::value ||
                            std::is_same<C, E5M2>::value;

// W 8-bit codes as fp32, vectorized (a scalar 256-entry table lookup per code would leave the 8-bit caches slower than
// fp32's): int8 widens; an fp8 code's magnitude bits shifted into an fp32's exponent and mantissa give its value
// times 2^-(127 - bias) (subnormals as fp32 denormals), which one multiply restores, as quant_decode.h does for
// weights. e4m3 0x7f (NaN) and e5m2 inf/NaN are never stored: writes clamp to +-qmax.
template <typename C>
inline vf decode8(const void* p) {
  if constexpr (std::is_same<C, I8>::value) {
    return __builtin_convertvector(pagoda_simd::vload_widen<true>(p), vf);
  } else {
    constexpr bool e4m3 = std::is_same<C, E4M3>::value;
    using pagoda_simd::vu;
    const vu v = (vu)pagoda_simd::vload_widen<false>(p);
    const vf mag = (vf)((v & 0x7F) << (e4m3 ? 20 : 21)) * (e4m3 ? 0x1p120f : 0x1p112f);
    return (vf)((vu)mag | ((v & 0x80) << 24));
  }
}

// S[R][KC] = Q[R][D] @ Kt[D][KC]. Q rows are ldq apart; scores for R rows stay in
// 2R vector registers while streaming over d.
template <int R>
inline void qk_tile(const float* __restrict q, int64_t ldq, const float* __restrict kt,
                    int64_t D, float* __restrict s) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    const vf k0 = vload(kt + d * KC), k1 = vload(kt + d * KC + W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float qv = q[r * ldq + d];
      acc0[r] += qv * k0;
      acc1[r] += qv * k1;
    }
  }
  for (int r = 0; r < R; ++r) {
    vstore(s + r * KC, acc0[r]);
    vstore(s + r * KC + W, acc1[r]);
  }
}

// O[R][D] += P[R][nk] @ V[nk][D], V given as nk row pointers (rows of a chunk may
// come from different cache blocks). D is a multiple of W.
template <int R>
inline void pv_tile(const float* __restrict p, const float* const* vrows, int nk,
                    int64_t D, float* __restrict o) {
  int64_t d = 0;
  for (; d + 2 * W <= D; d += 2 * W) {
    vf a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      a0[r] = vload(o + r * D + d);
      a1[r] = vload(o + r * D + d + W);
    }
    for (int j = 0; j < nk; ++j) {
      const vf v0 = vload(vrows[j] + d), v1 = vload(vrows[j] + d + W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float pv = p[r * KC + j];
        a0[r] += pv * v0;
        a1[r] += pv * v1;
      }
    }
    for (int r = 0; r < R; ++r) {
      vstore(o + r * D + d, a0[r]);
      vstore(o + r * D + d + W, a1[r]);
    }
  }
  for (; d < D; d += W) {
    vf a0[R];
    for (int r = 0; r < R; ++r) a0[r] = vload(o + r * D + d);
    for (int j = 0; j < nk; ++j) {
      const vf v0 = vload(vrows[j] + d);
      for (int r = 0; r < R; ++r) a0[r] += p[r * KC + j] * v0;
    }
    for (int r = 0; r < R; ++r) vstore(o + r * D + d, a0[r]);
  }
}

// The next chunk's cache lines, requested a few at a time from inside the current chunk's dot-product loops. A
// burst of a chunk's lines at once fills the core's miss buffers, and the loads behind them wait for it; spread
// over the chunk's arithmetic, the fetches overlap it. The lines are runs of evenly spaced addresses.
struct PrefetchQueue {
  struct Run {
    const char* base;
    int64_t stride, count;
  };
  static constexpr int kMaxRuns = 40;  // per group of 16 keys: K's one run and V's (at most 16 rows)
  Run runs[kMaxRuns];
  int n = 0, run = 0;
  int64_t i = 0;
  void clear() { n = run = 0, i = 0; }
  void add(const void* base, int64_t stride, int64_t count) {
    if (n < kMaxRuns) runs[n++] = {static_cast<const char*>(base), stride, count};
  }
  void issue(int k) {
    for (; k > 0 && run < n; --k) {
      __builtin_prefetch(runs[run].base + i * runs[run].stride, 0, 2);  // into L2, as prefetch_keys
      if (++i == runs[run].count) i = 0, ++run;
    }
  }
  void drain() { issue(std::numeric_limits<int>::max()); }
};

// Dispatch a row block of size 1..RB to the matching template instance.
template <template <int> class F, typename... A>
inline void dispatch_rows(int rows, A... args) {
  switch (rows) {
    case 1: F<1>::run(args...); break;
    case 2: F<2>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 7: F<7>::run(args...); break;
    default: F<8>::run(args...); break;
  }
}
template <int R> struct QK { template <typename... A> static void run(A... a) { qk_tile<R>(a...); } };
template <int R> struct PV { template <typename... A> static void run(A... a) { pv_tile<R>(a...); } };
static_assert(RB <= 8, "dispatch_rows covers 1..8 rows");

// One cache row of D (a multiple of W) values into fp32; an 8-bit row times its scale.
template <typename C>
inline void row_to_f32(const C* src, float* dst, int64_t D, float scale) {
  for (int64_t d = 0; d < D; d += W) {
    if constexpr (kQuantized<C>) vstore(dst + d, decode8<C>(src + d) * scale);
    else vstore(dst + d, pagoda_simd::vload_as(src + d));
  }
}

#if defined(__AVX512BF16__)
// S[R][KC] = scale * Q @ K^T over a bf16 cache whose K is stored as words (see paged_attention_cpu):
// k0[d2 * ld + j] = (k_j[2 d2], k_j[2 d2 + 1]) for keys 0..15 of the chunk, k1 the same for keys 16..31.
// One load gives a pair of d for 16 keys and one vdpbf16ps per row adds both products: no horizontal
// sums (row-major keys need a 16-way reduction per 16 scores, which cost more than the dot products)
// and no staging.
template <int R>
inline void qk_pairs_tile(const uint16_t* const* qrows, const uint32_t* __restrict k0p, const uint32_t* __restrict k1p,
                          int64_t ld, int64_t D, float scale, float* __restrict s, PrefetchQueue* pf) {
  static_assert(KC == 32, "two groups of 16 keys per chunk");
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    pf->issue(2);
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k0p + d2 * ld), k1 = (__m512bh)_mm512_loadu_si512(k1p + d2 * ld);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(qrows[r] + 2 * d2));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], k0, qb);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], k1, qb);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * KC, _mm512_mul_ps(acc0[r], sc));
    _mm512_storeu_ps(s + r * KC + 16, _mm512_mul_ps(acc1[r], sc));
  }
}
template <int R> struct QKP { template <typename... A> static void run(A... a) { qk_pairs_tile<R>(a...); } };

// O[R][D] += P[R][nk] @ V[nk][D] for bf16 V rows read in place, with P rounded to bf16 (as flash
// attention does): two keys' rows are interleaved into (v_j[d], v_j+1[d]) pairs, so one vdpbf16ps adds
// both keys' terms for 16 values of d. The interleave runs within 128-bit lanes, so O holds each group of
// 32 values of d permuted (see pv_unpermute); pb: P as bf16, rows KC apart.
template <int R, class VRow>
inline void pv_bf16_tile(const uint16_t* __restrict pb, VRow vrow, int nk, int64_t D, float* __restrict o,
                         PrefetchQueue* pf) {
  for (int64_t d = 0; d < D; d += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_loadu_ps(o + r * D + d);
      hi[r] = _mm512_loadu_ps(o + r * D + d + 16);
    }
    for (int j = 0; j < nk; j += 2) {  // an odd nk pairs its last key with zeros (p is 0 there too)
      pf->issue(2);
      const __m512i a = _mm512_loadu_si512(vrow(j) + d);
      const __m512i b = j + 1 < nk ? _mm512_loadu_si512(vrow(j + 1) + d) : _mm512_setzero_si512();
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(pb + r * KC + j));
        lo[r] = _mm512_dpbf16_ps(lo[r], vlo, pp);
        hi[r] = _mm512_dpbf16_ps(hi[r], vhi, pp);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * D + d, lo[r]);
      _mm512_storeu_ps(o + r * D + d + 16, hi[r]);
    }
  }
}

// Where pv_bf16_tile keeps d within its group of 32: 128-bit lane L of the unpacks holds d = 8L + 0..3
// (first 16 floats) and 8L + 4..7 (next 16). The permutex2var index over (first, next) that puts
// d = base..base+15 back in order.
struct PvUnpermute {
  alignas(64) int32_t idx[2][16];
  constexpr PvUnpermute() : idx() {
    for (int d = 0; d < 32; ++d) idx[d / 16][d % 16] = 16 * ((d % 8) / 4) + 4 * (d / 8) + d % 4;
  }
};
constexpr PvUnpermute kPvUnpermute;
inline __m512i pv_unpermute(int base) { return _mm512_load_si512(kPvUnpermute.idx[base / 16]); }
template <int R> struct PVB { template <typename... A> static void run(A... a) { pv_bf16_tile<R>(a...); } };
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Consecutive key positions through a block table, without a division per key (which cost more than a
// key's arithmetic in decode).
struct BlockWalk {
  const int32_t* bt;
  int64_t bs, index, off;
  BlockWalk(const int32_t* table, int64_t block_size, int64_t pos)
      : bt(table), bs(block_size), index(pos / block_size), off(pos % block_size) {}
  int64_t block() const { return bt[index]; }
  void next() {
    if (++off == bs) {
      off = 0;
      ++index;
    }
  }
};

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;  // queries [q_begin, q_end) within the sequence
  int64_t cost;
};

struct Args {
  int64_t Hq, Hkv, G, D, block_size, bt_stride;
  int64_t kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2;  // cache strides (inner dim contiguous)
  bool k_words;  // K as [num_blocks, Hkv, D/2, block_size, 2] (bf16; see paged_attention_cpu)
  const int32_t* block_tables;
  const int32_t* qsl;
  const int32_t* seq_lens;
  const float* k_scale;  // 8-bit caches: fp32 [num_blocks, Hkv, block_size] contiguous
  const float* v_scale;
  float scale;
  int64_t window;  // > 0: a query at p sees keys (p - window, p] only (sliding-window layers)
  float softcap;   // > 0: scores become softcap * tanh(score / softcap) before the mask
  // Draft trees (speculative decoding), or null: per query, bit j covers key seq_len - kTreeSpan + j; a clear bit
  // hides that key (on top of causality). -1: the query is causal only.
  const int64_t* tree_mask;
};
constexpr int64_t kTreeSpan = 64;

// A draft-tree query's keys as one sequence: keys before `base` are themselves, key base + i is slot[i].
struct TreeView {
  int64_t base = 0, n = 0;
  int32_t slot[kTreeSpan];
  int64_t len() const { return base + n; }
  int64_t operator()(int64_t key) const { return key < base ? key : slot[key - base]; }
};
// Query `qi` of sequence `seq`: its keys up to the first its word hides (up to itself with word -1), then those it
// keeps, never past itself.
inline TreeView tree_view(const Args& a, int64_t seq, int64_t qi) {
  const int64_t q0 = a.qsl[seq], seq_len = a.seq_lens[seq];
  const int64_t word = a.tree_mask[q0 + qi];
  const int64_t own = seq_len - (a.qsl[seq + 1] - q0) + qi;  // the query's own key
  const int64_t tree0 = seq_len - kTreeSpan;                 // the key bit 0 covers
  const auto sees = [&](int64_t key) {
    return word == -1 || key < tree0 || ((static_cast<uint64_t>(word) >> (key - tree0)) & 1);
  };
  TreeView v;
  v.base = std::max<int64_t>(0, tree0);
  while (v.base <= own && sees(v.base)) ++v.base;
  for (int64_t key = v.base; key <= own; ++key)
    if (sees(key)) v.slot[v.n++] = static_cast<int32_t>(key);
  return v;
}

// The keys [begin, end) a work item reads. With a window, keys start at the block holding the tile's first
// query's first key: blocks before it may have been freed (KVCacheManager frees blocks out of every query's
// window), and the keys of that block before the window are this sequence's own KV, masked in run_item.
// Block-aligned, so bf16 key groups of 16 stay within one block.
struct KeyRange {
  int64_t begin, end;
};
inline KeyRange key_range(const WorkItem& it, const Args& a) {
  const int64_t q_len = a.qsl[it.seq + 1] - a.qsl[it.seq];
  const int64_t ctx0 = a.seq_lens[it.seq] - q_len;
  const int64_t first_pos = ctx0 + it.q_begin;
  const int64_t begin = a.window > 0 ? std::max<int64_t>(0, first_pos - a.window + 1) / a.block_size * a.block_size : 0;
  return {begin, ctx0 + it.q_end};
}

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> q, s, o, kt, kr, vbuf, m, l, zeros;
  std::vector<const float*> vrows;
  std::vector<uint16_t> pb;  // bf16 caches: P in bf16
  std::vector<const uint16_t*> qrows16;
  std::vector<uint32_t> tree_k;  // bf16 caches with K words: a tree query's chunk gathered, as K words and V rows
  std::vector<uint16_t> tree_v;
  std::vector<TreeView> views;   // a tile of tree queries' views
  PrefetchQueue next_chunk;  // bf16 caches: the lines of the chunk after the current one
  Scratch(int64_t rows, int64_t D, int64_t block_size, int64_t v_stride, bool trees)
      : q(rows * D), s(rows * KC), o(rows * D), kt(D * KC), kr(KC * D), vbuf(KC * D), m(rows), l(rows * W),
        zeros(D, 0.f), vrows(KC), pb(rows * KC), qrows16(rows), tree_k(trees ? KC / 16 * D / 2 * block_size : 0),
        tree_v(trees ? KC * v_stride : 0), views(trees ? rows : 0) {}
};

// Requests keys [from, to) of one kv head into L2: a sequence's blocks lie anywhere in the pool, so the
// hardware prefetcher loses the stream at every block. Rows within a block are contiguous, so each run of
// keys in one block is one address range (K words: the block's whole tile for the head). Into L2: the
// L1 is too small to hold a chunk ahead next to the one being read.
template <typename C>
inline void prefetch_keys(const Args& a, const C* kc, const C* vc, const int32_t* bt, int64_t kv_head, int64_t from,
                          int64_t to) {
  const int64_t bs = a.block_size;
  for (int64_t pos = from; pos < to;) {
    const int64_t blk = bt[pos / bs], off = pos % bs, n = std::min(to - pos, bs - off);
    const char* kr = reinterpret_cast<const char*>(kc + blk * a.kc_s0 + kv_head * a.kc_s1 + (a.k_words ? 0 : off * a.kc_s2));
    const char* vr = reinterpret_cast<const char*>(vc + blk * a.vc_s0 + kv_head * a.vc_s1 + off * a.vc_s2);
    const int64_t kbytes = (a.k_words ? a.D * bs : (n - 1) * a.kc_s2 + a.D) * static_cast<int64_t>(sizeof(C));
    const int64_t vbytes = ((n - 1) * a.vc_s2 + a.D) * static_cast<int64_t>(sizeof(C));
    for (int64_t b = 0; b < kbytes; b += 64) __builtin_prefetch(kr + b, 0, 2);  // locality 2: into L2
    for (int64_t b = 0; b < vbytes; b += 64) __builtin_prefetch(vr + b, 0, 2);
    pos += n;
  }
}

// Where a chunk of keys [c0, c0 + nk) of one kv head lies in a bf16 cache with K words: both groups of 16 keys lie
// within one block each (block_size % 16 == 0), K words start at k[g], V row j is v[j / 16] + (j % 16) * stride. A
// group past nk repeats the first: its keys are masked, and no block past the sequence is touched.
struct Bf16Chunk {
  const uint32_t* k[KC / 16];
  const uint16_t* v[KC / 16];
};
template <typename C>
inline Bf16Chunk bf16_chunk(const Args& a, const C* kc, const C* vc, const WorkItem& it, int64_t c0, int nk) {
  const int32_t* bt = a.block_tables + it.seq * a.bt_stride;
  Bf16Chunk ch;
  for (int g = 0; g < KC / 16; ++g) {
    const int64_t pos = c0 + 16 * std::min(g, (nk - 1) / 16), blk = bt[pos / a.block_size], off = pos % a.block_size;
    ch.k[g] = reinterpret_cast<const uint32_t*>(kc + blk * a.kc_s0 + it.kv_head * a.kc_s1) + off;
    ch.v[g] = reinterpret_cast<const uint16_t*>(vc + blk * a.vc_s0 + it.kv_head * a.vc_s1 + off * a.vc_s2);
  }
  return ch;
}
// The cache lines of such a chunk: per group, D/2 rows of 16 K words and 16 V rows.
inline void queue_chunk(const Args& a, const Bf16Chunk& ch, int nk, PrefetchQueue& pf) {
  pf.clear();
  const int64_t row_lines = a.D * 2 / 64;  // a V row's (D % 32 == 0)
  for (int g = 0; g < KC / 16; ++g) {
    if (g > 0 && ch.k[g] == ch.k[g - 1]) break;  // a repeated group (nk <= 16)
    pf.add(ch.k[g], a.block_size * 4, a.D / 2);  // one line of 16 K words per pair of d
    const int64_t rows = std::min(16, nk - 16 * g);
    if (a.vc_s2 == a.D) {
      pf.add(ch.v[g], 64, rows * row_lines);  // the group's V rows are contiguous
    } else {
      for (int64_t j = 0; j < rows; ++j) pf.add(ch.v[g] + j * a.vc_s2, 64, row_lines);
    }
  }
}

// A tree query's chunk of keys [c0, c0 + nk) of its view, copied into scratch laid out as the cache is (K words
// block_size apart, V rows vc_s2 apart), so the bf16 kernels read it as they read a chunk in place. Keys past nk
// are zeros (masked).
template <typename C>
inline Bf16Chunk gather_bf16_chunk(const Args& a, const C* kc, const C* vc, const WorkItem& it,
                                   const TreeView& view, int64_t c0, int nk, Scratch& sc) {
  const int32_t* bt = a.block_tables + it.seq * a.bt_stride;
  const int64_t bs = a.block_size, half = a.D / 2;
  Bf16Chunk ch;
  for (int g = 0; g < KC / 16; ++g) {
    uint32_t* kg = sc.tree_k.data() + g * half * bs;
    uint16_t* vg = sc.tree_v.data() + g * 16 * a.vc_s2;
    for (int jj = 0; jj < 16; ++jj) {
      const int j = g * 16 + jj;
      uint16_t* vrow = vg + jj * a.vc_s2;
      if (j >= nk) {
        for (int64_t d2 = 0; d2 < half; ++d2) kg[d2 * bs + jj] = 0;
        std::fill(vrow, vrow + a.D, uint16_t{0});
        continue;
      }
      const int64_t slot = view(c0 + j), blk = bt[slot / bs], off = slot % bs;
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(kc + blk * a.kc_s0 + it.kv_head * a.kc_s1) + off;
      for (int64_t d2 = 0; d2 < half; ++d2) kg[d2 * bs + jj] = kw[d2 * bs];
      const uint16_t* vsrc = reinterpret_cast<const uint16_t*>(vc + blk * a.vc_s0 + it.kv_head * a.vc_s1 + off * a.vc_s2);
      std::copy(vsrc, vsrc + a.D, vrow);
    }
    ch.k[g] = kg;
    ch.v[g] = vg;
  }
  return ch;
}

// T: the dtype of q and out; C: the cache element (T itself, or an 8-bit tag). `following`: the item this thread
// runs next (or null); over a bf16 cache its first chunk is fetched during this item's last, so `first_queued` (not
// the thread's first item) says the previous item did that for this one.
template <typename T, typename C>
void run_item(const WorkItem& it, const Args& a, const T* __restrict q, const C* __restrict kc,
              const C* __restrict vc, T* __restrict out, Scratch& sc, const WorkItem* following, bool first_queued) {
  const int64_t D = a.D, G = a.G, bs = a.block_size;
  const int64_t q0 = a.qsl[it.seq];
  const int64_t nq = it.q_end - it.q_begin;
  const int64_t rows = nq * G;
  auto [kv_begin, kv_end] = key_range(it, a);
  const int64_t first_pos = kv_end - nq;  // position of the tile's first query
  const int32_t* bt = a.block_tables + it.seq * a.bt_stride;
  // A tile of tree queries: each query's view of its keys; keys before `shared` are every view's own.
  const bool tree = a.tree_mask != nullptr && a.tree_mask[q0 + it.q_begin] != -1;
  TreeView* views = sc.views.data();
  int64_t shared = kv_end;
  if (tree) {
    kv_end = 0;
    for (int64_t i = 0; i < nq; ++i) {
      views[i] = tree_view(a, it.seq, it.q_begin + i);
      shared = std::min(shared, views[i].base);
      kv_end = std::max(kv_end, views[i].len());
    }
    if (a.window > 0) {  // from the first position the tile's views reach (queries past the first sit deeper)
      int64_t p = kv_end;
      for (int64_t i = 0; i < nq; ++i) p = std::min(p, views[i].len() - 1);
      kv_begin = std::max<int64_t>(0, p - a.window + 1) / bs * bs;
    }
  }
  // Row r's query position (a tree query's in its view).
  const auto row_pos = [&](int64_t r) { return tree ? views[r / G].len() - 1 : first_pos + r / G; };

  // A bf16 cache with K words is read in place: K by qk_pairs_tile, V rows by pv_bf16_tile.
  const bool bf16_cache = kBf16Dot && std::is_same<C, c10::BFloat16>::value && a.k_words;
  // Row r = (query i, head h of the group) with r = i * G + h; pre-scale Q (bf16 caches scale S).
  float* Q = sc.q.data();
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < G; ++h) {
      const T* src = q + ((q0 + it.q_begin + i) * a.Hq + it.kv_head * G + h) * D;
      if (bf16_cache) {
        sc.qrows16[i * G + h] = reinterpret_cast<const uint16_t*>(src);
        continue;
      }
      float* dst = Q + (i * G + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * a.scale;
    }
  float* O = sc.o.data();
  std::fill(O, O + rows * D, 0.f);
  float* M = sc.m.data();
  float* L = sc.l.data();
  std::fill(M, M + rows, -std::numeric_limits<float>::infinity());
  std::fill(L, L + rows * W, 0.f);
  float* S = sc.s.data();
  float* Kt = sc.kt.data();
  const float** vrows = sc.vrows.data();

  // Over a bf16 cache, where the current chunk lies (no table of row pointers: a block lookup per key cost as much
  // as the chunk's dot products). Unused in builds without AVX512-BF16.
  [[maybe_unused]] Bf16Chunk chunk{}, next_chunk{};
  const int64_t vs2 = a.vc_s2;
  [[maybe_unused]] const auto vrow_seg = [&](int j) { return chunk.v[j >> 4] + (j & 15) * vs2; };
  [[maybe_unused]] PrefetchQueue& pf = sc.next_chunk;

  // Keys [c0, c0 + nk) for rows [r_lo, r_hi): read in place (view null: keys are their slots), or through a
  // tree query's view.
  const auto run_chunk = [&](int64_t c0, int nk, int64_t r_lo, int64_t r_hi, const TreeView* view)
                             __attribute__((always_inline)) {
#if defined(__AVX512BF16__)
    if (bf16_cache) {
      // Keys past nk within a group are whatever the block holds: masked in S, and PV stops at nk.
      if (view != nullptr) {
        chunk = gather_bf16_chunk(a, kc, vc, it, *view, c0, nk, sc);
        pf.clear();
      } else {
        chunk = c0 == kv_begin ? bf16_chunk(a, kc, vc, it, c0, nk) : next_chunk;  // the one queued last time
        if (c0 == kv_begin && !first_queued) prefetch_keys(a, kc, vc, bt, it.kv_head, c0, c0 + nk);
        const bool next_in_place = !tree || c0 + 2 * KC <= shared;
        if (c0 + KC < kv_end && next_in_place) {
          const int next_nk = static_cast<int>(std::min<int64_t>(KC, kv_end - c0 - KC));
          next_chunk = bf16_chunk(a, kc, vc, it, c0 + KC, next_nk);
          queue_chunk(a, next_chunk, next_nk, pf);
        } else if (c0 + KC >= kv_end && following != nullptr) {
          const KeyRange r = key_range(*following, a);
          const int next_nk = static_cast<int>(std::min<int64_t>(KC, r.end - r.begin));
          queue_chunk(a, bf16_chunk(a, kc, vc, *following, r.begin, next_nk), next_nk, pf);
        } else {
          pf.clear();  // the next chunk is gathered per tree query, or there is none
        }
      }
      for (int64_t r0 = r_lo; r0 < r_hi; r0 += RB)
        dispatch_rows<QKP>(static_cast<int>(std::min<int64_t>(RB, r_hi - r0)),
                           static_cast<const uint16_t* const*>(sc.qrows16.data() + r0),
                           static_cast<const uint32_t*>(chunk.k[0]), static_cast<const uint32_t*>(chunk.k[1]), bs, D,
                           a.scale, S + r0 * KC, &pf);
    } else
#endif
    {
    if (view == nullptr) {
      if (c0 == kv_begin) prefetch_keys(a, kc, vc, bt, it.kv_head, c0, std::min<int64_t>(kv_end, c0 + KC));
      prefetch_keys(a, kc, vc, bt, it.kv_head, c0 + KC, std::min(std::min(kv_end, shared), c0 + 2 * KC));
    }
    // Gather the chunk: K transposed to [D][KC] fp32, V as row pointers (fp32 cache
    // is read in place; bf16 and 8-bit rows are converted into scratch).
    {  // K rows staged row-major in fp32 (8-bit ones decoded and scaled), then transposed W x W at a time
      float* Kr = sc.kr.data();
      BlockWalk walk(bt, bs, c0);
      for (int j = 0; j < KC; ++j, walk.next()) {
        if (j >= nk) {  // padding keys never touch the cache (it may hold NaN garbage); they are masked
          std::fill(Kr + j * D, Kr + (j + 1) * D, 0.f);
          vrows[j] = sc.zeros.data();
          continue;
        }
        const int64_t slot = view != nullptr ? (*view)(c0 + j) : c0 + j;
        const int64_t blk = slot == c0 + j ? walk.block() : bt[slot / bs], off = slot % bs;
        const C* krow = kc + blk * a.kc_s0 + it.kv_head * a.kc_s1 + off * a.kc_s2;
        const C* vrow = vc + blk * a.vc_s0 + it.kv_head * a.vc_s1 + off * a.vc_s2;
        float ks = 1.f, vs = 1.f;
        if constexpr (kQuantized<C>) {
          const int64_t srow = (blk * a.Hkv + it.kv_head) * bs + off;
          ks = a.k_scale[srow];
          vs = a.v_scale[srow];
        }
        row_to_f32(krow, Kr + j * D, D, ks);
        if constexpr (std::is_same<C, float>::value) {
          vrows[j] = vrow;
        } else {
          float* vb = sc.vbuf.data() + j * D;
          row_to_f32(vrow, vb, D, vs);
          vrows[j] = vb;
        }
      }
      for (int jb = 0; jb < KC; jb += W)
        for (int64_t db = 0; db < D; db += W) transpose_block(Kr + jb * D + db, D, Kt + db * KC + jb, KC);
    }

    for (int64_t r0 = r_lo; r0 < r_hi; r0 += RB) {
      const int rb = static_cast<int>(std::min<int64_t>(RB, r_hi - r0));
      dispatch_rows<QK>(rb, static_cast<const float*>(Q + r0 * D), D,
                        static_cast<const float*>(Kt), D, S + r0 * KC);
    }
    }

    // Causal mask only where the chunk reaches past the row's query; the window's only where the chunk starts
    // before the query's window.
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int64_t r = r_lo; r < r_hi; ++r) {
      float* sr = S + r * KC;
      if (a.softcap > 0.f)
        for (int j = 0; j < KC; ++j) sr[j] = a.softcap * std::tanh(sr[j] / a.softcap);
      const int64_t pos = row_pos(r);
      if (c0 + KC - 1 > pos)
        for (int j = 0; j < KC; ++j)
          if (c0 + j > pos) sr[j] = kNegInf;
      if (a.window > 0 && c0 <= pos - a.window)
        for (int j = 0; j < KC; ++j)
          if (c0 + j <= pos - a.window) sr[j] = kNegInf;
      const vf s0 = vload(sr), s1 = vload(sr + W);
      const float cmax = hmax(s0 > s1 ? s0 : s1);
      // Without a window every row has a finite max after chunk 0. With one, a later query's row may have
      // none yet (its window starts past this chunk): it takes nothing from the chunk.
      if (cmax == kNegInf && M[r] == kNegInf) {
        std::fill(sr, sr + KC, 0.f);
        continue;
      }
      const float m_new = std::max(M[r], cmax);
      const float alpha = std::exp(M[r] - m_new);  // exp(-inf) = 0 on the first chunk
      const vf p0 = vexp_masked(s0 - m_new), p1 = vexp_masked(s1 - m_new);
      vstore(sr, p0);
      vstore(sr + W, p1);
      // Row sums stay vectors until the end: no horizontal add per chunk.
      vstore(L + r * W, vload(L + r * W) * alpha + (p0 + p1));
      M[r] = m_new;
      if (alpha != 1.f) {
        float* orow = O + r * D;
        for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
      }
    }

#if defined(__AVX512BF16__)
    if (bf16_cache) {
      uint16_t* pb = sc.pb.data();
      for (int64_t r = r_lo; r < r_hi; ++r)
        _mm512_storeu_si512(pb + r * KC, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(S + r * KC + W),
                                                                      _mm512_loadu_ps(S + r * KC)));
      for (int64_t r0 = r_lo; r0 < r_hi; r0 += RB)
        dispatch_rows<PVB>(static_cast<int>(std::min<int64_t>(RB, r_hi - r0)),
                           static_cast<const uint16_t*>(pb + r0 * KC), vrow_seg, nk, D, O + r0 * D, &pf);
      pf.drain();
      return;
    }
#endif
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += RB) {
      const int rb = static_cast<int>(std::min<int64_t>(RB, r_hi - r0));
      dispatch_rows<PV>(rb, static_cast<const float*>(S + r0 * KC),
                        static_cast<const float* const*>(vrows), nk, D, O + r0 * D);
    }
  };

  for (int64_t c0 = kv_begin; c0 < kv_end; c0 += KC) {
    if (c0 + KC <= shared || !tree) {
      run_chunk(c0, static_cast<int>(std::min<int64_t>(KC, kv_end - c0)), 0, rows, nullptr);
      continue;
    }
    for (int64_t i = 0; i < nq; ++i)  // past the keys the views share: each query's own chunk
      if (c0 < views[i].len())
        run_chunk(c0, static_cast<int>(std::min<int64_t>(KC, views[i].len() - c0)), i * G, (i + 1) * G, &views[i]);
  }

  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = i * G + h;
      const float inv = 1.f / hsum(vload(L + r * W));
      T* dst = out + ((q0 + it.q_begin + i) * a.Hq + it.kv_head * G + h) * D;
      const float* src = O + r * D;
#if defined(__AVX512BF16__)
      if (bf16_cache) {
        for (int64_t d = 0; d < D; d += 32) {
          const __m512 lo = _mm512_loadu_ps(src + d), hi = _mm512_loadu_ps(src + d + 16);
          store16(dst + d, _mm512_mul_ps(_mm512_permutex2var_ps(lo, pv_unpermute(0), hi), _mm512_set1_ps(inv)));
          store16(dst + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, pv_unpermute(16), hi), _mm512_set1_ps(inv)));
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * inv);
    }
}

template <typename T, typename C = T>
void run_all(const std::vector<WorkItem>& items, const Args& a, const at::Tensor& q,
             const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out, int64_t max_rows) {
  const T* qp = q.const_data_ptr<T>();
  const C* kp = static_cast<const C*>(kc.const_data_ptr());
  const C* vp = static_cast<const C*>(vc.const_data_ptr());
  T* op = out.mutable_data_ptr<T>();
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  // at::parallel_for splits ranges statically; items have very different costs
  // (decode vs long prefill), so each thread pulls items (sorted by descending
  // cost) from a shared counter instead, one ahead, so that it can fetch that item's first keys early.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    Scratch sc(max_rows, a.D, a.block_size, a.vc_s2, a.tree_mask != nullptr);
    for (int64_t i = next.fetch_add(1), first = i; i < n;) {
      const int64_t j = next.fetch_add(1);
      run_item<T, C>(items[i], a, qp, kp, vp, op, sc, j < n ? &items[j] : nullptr, i != first);
      i = j;
    }
  });
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               double scale, const c10::optional<at::Tensor>& k_scale,
                               const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                               const c10::optional<at::Tensor>& tree_mask) {
  // K is [num_blocks, Hkv, block_size, D] like V, or, for bf16 caches (kernels/paged_attention.py:
  // k_cache_shape), [num_blocks, Hkv, D/2, block_size, 2]: words of two d for consecutive keys, so one
  // 64-byte load holds a pair of d for 16 keys, as vdpbf16ps takes them.
  const bool k_words = k_cache.dim() == 5;
  TORCH_CHECK(q.dim() == 3 && (k_cache.dim() == 4 || k_words) && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  const at::ScalarType cache_t = k_cache.scalar_type();
  const bool quant = k_scale.has_value();
  TORCH_CHECK(v_cache.scalar_type() == cache_t, "k_cache and v_cache must share a dtype");
  if (quant) {
    TORCH_CHECK(v_scale.has_value(), "k_scale without v_scale");
    TORCH_CHECK(cache_t == at::kChar || cache_t == at::kFloat8_e4m3fn || cache_t == at::kFloat8_e5m2,
                "scales need an int8/fp8 cache, got ", cache_t);
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "8-bit caches must be contiguous");
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                      s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) &&
                      s->size(2) == k_cache.size(2),
                  "scales must be fp32 [num_blocks, Hkv, block_size]");
  } else {
    TORCH_CHECK(cache_t == q.scalar_type(), "q, k_cache and v_cache must share a dtype");
  }
  TORCH_CHECK(k_cache.stride(-1) == 1 && v_cache.stride(3) == 1, "cache inner dim must be contiguous");
  if (k_words) {
    TORCH_CHECK(kBf16Dot && cache_t == at::kBFloat16 && !quant, "K words need a bf16 cache and AVX512-BF16");
    TORCH_CHECK(k_cache.is_contiguous() && k_cache.size(4) == 2 && k_cache.size(0) == v_cache.size(0) &&
                    k_cache.size(1) == v_cache.size(1) && k_cache.size(2) * 2 == v_cache.size(3) &&
                    k_cache.size(3) == v_cache.size(2) && v_cache.size(2) % 16 == 0 && v_cache.size(3) % 32 == 0,
                "K words must be [num_blocks, Hkv, D/2, block_size, 2] with block_size % 16 == 0, D % 32 == 0");
  } else {
    TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k/v cache shapes differ");
  }
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "index tensors must be int32");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1);
  TORCH_CHECK(v_cache.size(3) == D && D % W == 0, "head dim must match and be a multiple of ", W);
  TORCH_CHECK(Hq % Hkv == 0, "Hq must be a multiple of Hkv");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) >= B, "batch size mismatch");

  Args a;
  a.Hq = Hq; a.Hkv = Hkv; a.G = Hq / Hkv; a.D = D; a.block_size = v_cache.size(2);
  a.k_words = k_words;
  a.bt_stride = block_tables.stride(0);
  a.kc_s0 = k_cache.stride(0); a.kc_s1 = k_cache.stride(1); a.kc_s2 = k_cache.stride(2);
  a.vc_s0 = v_cache.stride(0); a.vc_s1 = v_cache.stride(1); a.vc_s2 = v_cache.stride(2);
  a.block_tables = block_tables.const_data_ptr<int32_t>();
  a.qsl = query_start_loc.const_data_ptr<int32_t>();
  a.seq_lens = seq_lens.const_data_ptr<int32_t>();
  a.scale = static_cast<float>(scale);
  a.k_scale = quant ? k_scale->const_data_ptr<float>() : nullptr;
  a.v_scale = quant ? v_scale->const_data_ptr<float>() : nullptr;
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  a.tree_mask = nullptr;
  if (tree_mask.has_value()) {
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong && tree_mask->is_contiguous() && tree_mask->dim() == 1 &&
                    tree_mask->size(0) == q.size(0),
                "tree_mask must be int64 [T], contiguous");
    a.tree_mask = tree_mask->const_data_ptr<int64_t>();
  }
  TORCH_CHECK(a.qsl[0] == 0 && a.qsl[B] == T, "query_start_loc must span q");

  // Query tile: about TARGET_ROWS rows (queries x group heads) per item.
  const int64_t tile_q = std::max<int64_t>(1, TARGET_ROWS / a.G);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b];
    const int64_t ctx0 = a.seq_lens[b] - q_len;
    TORCH_CHECK(q_len >= 0 && ctx0 >= 0, "seq_lens[", b, "] smaller than its query count");
    TORCH_CHECK((a.seq_lens[b] + a.block_size - 1) / a.block_size <= block_tables.size(1),
                "block table too short for seq ", b);
    // Tree queries (a mask word other than -1) come after the causal ones: tiles of their own (tree_view).
    int64_t first_tree = q_len;
    if (a.tree_mask != nullptr)
      for (int64_t i = 0; i < q_len && first_tree == q_len; ++i)
        if (a.tree_mask[a.qsl[b] + i] != -1) first_tree = i;
    for (int64_t i0 = 0, i1; i0 < q_len; i0 = i1) {
      i1 = std::min(i0 < first_tree ? first_tree : q_len, i0 + tile_q);
      for (int64_t g = 0; g < Hkv; ++g)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(g), static_cast<int32_t>(i0),
                         static_cast<int32_t>(i1),
                         (i1 - i0) * (window > 0 ? std::min(ctx0 + i1, window + i1 - i0) : ctx0 + i1)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t max_rows = tile_q * a.G;
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: unsupported dtype ", q.scalar_type());
  const bool f32 = q.scalar_type() == at::kFloat;
  if (!quant) {
    if (f32) run_all<float>(items, a, q, k_cache, v_cache, out, max_rows);
    else run_all<c10::BFloat16>(items, a, q, k_cache, v_cache, out, max_rows);
  } else if (cache_t == at::kChar) {
    if (f32) run_all<float, I8>(items, a, q, k_cache, v_cache, out, max_rows);
    else run_all<c10::BFloat16, I8>(items, a, q, k_cache, v_cache, out, max_rows);
  } else if (cache_t == at::kFloat8_e4m3fn) {
    if (f32) run_all<float, E4M3>(items, a, q, k_cache, v_cache, out, max_rows);
    else run_all<c10::BFloat16, E4M3>(items, a, q, k_cache, v_cache, out, max_rows);
  } else {
    if (f32) run_all<float, E5M2>(items, a, q, k_cache, v_cache, out, max_rows);
    else run_all<c10::BFloat16, E5M2>(items, a, q, k_cache, v_cache, out, max_rows);
  }
  return out;
}

}  // namespace

namespace pagoda_cpu {
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                           const c10::optional<at::Tensor>& tree_mask) {
  return paged_attention_cpu(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale,
                             window, softcap, tree_mask);
}
}  // namespace pagoda_cpu

// FRAGMENT so other pagoda C++ sources can add ops to the same namespace.
TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor? k_scale=None, "
      "Tensor? v_scale=None, int window=0, float softcap=0., Tensor? tree_mask=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }
