// The ISA-specific steps of the portable kernels (kernels/cpu/simd.h, quant_decode.h, vec_bf16.h) against their definition,
// lane by lane, bit for bit: tests/test_kernels_arm.py builds this for x86 (AVX2, AVX-512) and runs it, and builds it
// for aarch64 (NEON) and runs it under qemu. The quantized kernels are chains of exactly these steps (decode the
// codes, one FMA into a weight, FMA chains, one horizontal-sum tree), so every build computes what the x86 kernel
// tests check. Prints one line per check and exits 1 on the first lane that differs.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "gguf_blocks.h"
#include "int4x8_i8.h"
#include "quant_decode.h"
#include "simd.h"
#include "vec_bf16.h"

using namespace pagoda_simd;

namespace {

int failures = 0;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

bool expect_quiet(const char* what, const float* got, const float* want, int n) {
  for (int i = 0; i < n; ++i)
    if (bits(got[i]) != bits(want[i])) {
      std::printf("FAIL %s lane %d: %.9g (%08x), want %.9g (%08x)\n", what, i, got[i], bits(got[i]), want[i],
                  bits(want[i]));
      ++failures;
      return false;
    }
  return true;
}

void expect(const char* what, const float* got, const float* want, int n) {
  if (expect_quiet(what, got, want, n)) std::printf("ok %s\n", what);
}

// e4m3fn's value by its definition (codes 0x7F and 0xFF, NaN, are not used below).
float e4m3(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return c & 0x80 ? -mag : mag;
}

float tree(const float* v) {  // hsum's order: the upper half of the lanes onto the lower, halving
  float a[W];
  std::memcpy(a, v, sizeof(a));
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

template <int F>
void check_format(const char* name, const uint8_t* codes, const float* x) {
  const int64_t step = F == pagoda_cpu::kInt4 ? W : 2 * W;  // code bytes per 2W weights
  const float s = 0.0123f, o = -0.0456f;
  vf acc = vf{};
  float acc_ref[W] = {};
  for (int64_t j = 0; j < 4; ++j) {
    const uint8_t* p = codes + j * step;
    vf a, b;
    decode_codes<F>(p, a, b);
    float got[2 * W], want[2 * W];
    vstore(got, a);
    vstore(got + W, b);
    for (int i = 0; i < W; ++i) {
      if constexpr (F == pagoda_cpu::kInt4) {
        want[i] = static_cast<float>(p[i] & 0xF);
        want[W + i] = static_cast<float>(p[i] >> 4);
      } else if constexpr (F == pagoda_cpu::kInt8) {
        want[i] = static_cast<float>(static_cast<int8_t>(p[i]));
        want[W + i] = static_cast<float>(static_cast<int8_t>(p[W + i]));
      } else {
        want[i] = e4m3(p[i]);
        want[W + i] = e4m3(p[W + i]);
      }
    }
    char what[64];
    std::snprintf(what, sizeof(what), "%s decode step %lld", name, static_cast<long long>(j));
    expect(what, got, want, 2 * W);
    // the kernels' chain: w = code * s + o, then acc = b * xb + (a * xa + acc), each FMA rounded once
    a = vfma(a, vsplat(s), vsplat(o));
    b = vfma(b, vsplat(s), vsplat(o));
    acc = vfma(b, vload(x + j * 2 * W + W), vfma(a, vload(x + j * 2 * W), acc));
    for (int i = 0; i < W; ++i) {
      const float wa = std::fma(want[i], s, o), wb = std::fma(want[W + i], s, o);
      acc_ref[i] = std::fma(wb, x[j * 2 * W + W + i], std::fma(wa, x[j * 2 * W + i], acc_ref[i]));
    }
  }
  float got[W];
  vstore(got, acc);
  char what[64];
  std::snprintf(what, sizeof(what), "%s fma chain", name);
  expect(what, got, acc_ref, W);
  const float sum = hsum(acc), sum_ref = tree(acc_ref);
  std::snprintf(what, sizeof(what), "%s hsum", name);
  expect(what, &sum, &sum_ref, 1);
}

// transpose_block over strided rows (as paged attention stages K: rows D apart, into columns 2W apart).
void check_transpose() {
  constexpr int lds = W + 3, ldd = 2 * W;
  float src[W * lds], got[W * ldd], want[W * ldd];
  for (int i = 0; i < W * lds; ++i) src[i] = static_cast<float>(i) + 0.25f;
  for (int i = 0; i < W * ldd; ++i) got[i] = want[i] = -1.f;  // the columns past W stay untouched
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) want[j * ldd + i] = src[i * lds + j];
  transpose_block(src, lds, got, ldd);
  expect("transpose_block", got, want, W * ldd);
}

// bf16 <-> fp32 (the fused ops' loads and stores) against c10::BFloat16's definition: widening is exact,
// narrowing rounds to nearest even and any NaN becomes 0x7FC0; then vexp (vmin, vmax, FMAs and the exponent
// bits) against its scalar definition.
void check_bf16_and_exp(const float* x) {
  float v[4 * W];
  for (int i = 0; i < 4 * W; ++i) v[i] = x[i] * 1.7f;
  const uint32_t specials[] = {0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x7F7FFFFFu, 0x7F800000u,
                               0xFF800000u, 0x7FC00001u, 0xFFFFFFFFu, 0x00018000u, 0x80000000u};
  for (int i = 0; i < 10; ++i) std::memcpy(&v[3 * i], &specials[i], 4);  // ties both ways, overflow, NaN
  uint16_t h[4 * W];
  float got[4 * W], want[4 * W];
  for (int j = 0; j < 4; ++j) vstore_bf16(h + j * W, vload(v + j * W));
  for (int i = 0; i < 4 * W; ++i) {
    const uint32_t u = bits(v[i]);
    const uint32_t r = v[i] != v[i] ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&want[i], &r, 4);
    const uint32_t g = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(&got[i], &g, 4);
  }
  expect("bf16 store", got, want, 4 * W);
  for (int j = 0; j < 4; ++j) vstore(got + j * W, vload_bf16(h + j * W));
  for (int j = 0; j < 4; ++j) vstore(want + j * W, vround_bf16(vload(v + j * W)));
  expect("bf16 load and round", got, want, 4 * W);
  float e[4 * W];
  for (int i = 0; i < 4 * W; ++i) e[i] = x[i] * (i % 3 == 0 ? 2.5f : 0.1f) + (i == 5 ? -120.f : i == 9 ? 95.f : 0.f);
  for (int j = 0; j < 4; ++j) vstore(got + j * W, vexp(vload(e + j * W)));
  for (int i = 0; i < 4 * W; ++i) {
    const float c = std::min(std::max(e[i], -87.f), 88.f);
    const float n = std::fma(c, 1.44269504088896341f, 12583039.f) - 12583039.f;
    const float r = std::fma(-n, 1.428606765330187e-06f, std::fma(-n, 0.693145751953125f, c));
    float p = 1.f / 5040.f;
    for (float k : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = std::fma(p, r, k);
    want[i] = p * std::ldexp(1.f, static_cast<int>(n));
  }
  expect("vexp", got, want, 4 * W);
}

// vload_half (fp16 scales) against fp16's definition: (-1)^s 2^(e-15) (1 + m/1024), subnormals m 2^-24, infinities.
void check_half() {
  uint16_t h[4 * W];
  const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xC000, 0x7BFF, 0x7C00, 0xFC00, 0x3555};
  for (int i = 0; i < 4 * W; ++i)  // the specials, then finite values of both signs
    h[i] = i < 11 ? specials[i] : static_cast<uint16_t>(((i * 40503u) & 0x7BFF) | (i % 2 ? 0x8000u : 0u));
  float got[4 * W], want[4 * W];
  for (int j = 0; j < 4; ++j) vstore(got + j * W, vload_half(h + j * W));
  for (int i = 0; i < 4 * W; ++i) {
    const int e = (h[i] >> 10) & 0x1F, m = h[i] & 0x3FF;
    const float mag = e == 31 ? INFINITY
                      : e == 0 ? std::ldexp(static_cast<float>(m), -24)
                               : std::ldexp(1.f + m / 1024.f, e - 15);
    want[i] = h[i] & 0x8000 ? -mag : mag;
  }
  expect("fp16 load", got, want, 4 * W);
}

float half_value(uint16_t h) {  // finite fp16 only
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(1.f + m / 1024.f, e - 15);
  return h & 0x8000 ? -mag : mag;
}

// A GGUF type's block decoder (gguf_blocks.h) against its layout, read byte by byte: two super-block panels of random
// bytes (finite fp16 fields), every k's codes and every group's scales and offsets.
template <int64_t T>
void check_gguf(const char* name, uint32_t& state) {
  using B = pagoda_gguf::Blocks<T>;
  using Tr = typename B::Tr;
  constexpr int P = 2 * W, K = 2 * Tr::kBlock, fields = Tr::kMin ? 2 : 1;
  static uint8_t data[2 * B::kBytes];
  for (uint8_t& c : data) {
    state = state * 1664525u + 1013904223u;
    c = static_cast<uint8_t>(state >> 24);
  }
  for (int sb = 0; sb < 2; ++sb)
    for (int i = 0; i < fields * P; ++i) data[sb * B::kBytes + 2 * i + 1] &= 0xBB;  // exponents below 31
  const B src(data, K);
  float got[2 * W], want[2 * W];
  for (int k = 0; k < K; ++k) {
    const uint8_t* b = data + (k / Tr::kBlock) * B::kBytes + B::kMeta;
    const int kk = k % Tr::kBlock;
    vf lo, hi;
    src.load(0, k, lo, hi);
    vstore(got, lo);
    vstore(got + W, hi);
    for (int c = 0; c < P && B::kWholeBytes; ++c) want[c] = static_cast<int8_t>(b[kk * P + c]);
    for (int c = 0; c < P && !B::kWholeBytes; ++c) {
      const uint8_t byte = b[kk * W + c % W];
      int q = c < W ? byte & 0xF : byte >> 4;
      for (int i = 0; i < Tr::kHigh; ++i) {
        const int bit = c * Tr::kHigh + i;
        q |= ((b[Tr::kBlock * W + kk * B::kHighBytes + bit / 8] >> (bit % 8)) & 1) << (4 + i);
      }
      want[c] = static_cast<float>(q - Tr::kBias);
    }
    expect_quiet(name, got, want, P);
  }
  for (int g = 0; g < K / Tr::kGroup; ++g) {
    const uint8_t* b = data + (g / B::kGroups) * B::kBytes;
    const int j = g % B::kGroups;
    const auto grp = src.group(0, g);
    float gs[2 * W], go[2 * W], ws[2 * W], wo[2 * W];
    vstore(gs, grp.s0);
    vstore(gs + W, grp.s1);
    vstore(go, grp.o0);
    vstore(go + W, grp.o1);
    for (int c = 0; c < P; ++c) {
      auto u16 = [&](int at) { uint16_t h; std::memcpy(&h, b + at, 2); return h; };
      const uint8_t* sc = b + 2 * P * fields + j * P;
      const float sub = !Tr::kSubScales ? 1.f : Tr::kSignedScales ? static_cast<int8_t>(sc[c]) : sc[c];
      ws[c] = half_value(u16(2 * c)) * sub;
      wo[c] = Tr::kMin ? -(half_value(u16(2 * P + 2 * c)) * b[4 * P + B::kGroups * P + j * P + c]) : 0.f;
    }
    expect_quiet(name, gs, ws, P);
    expect_quiet(name, go, wo, P);
  }
  if (!failures) std::printf("ok %s block decoder\n", name);
}

#if defined(PAGODA_INT4X8_I8)
// The INT4 x INT8-activation kernel (int4x8_i8.h) against its definition: per output, one chain over the 32-column
// halves in k order of fma(integer sum of code * xq, s * a), then fma(offset, group sum of x) per group, plus the
// bias; codes and activations packed as kernels/quant_linear.py's interleave8 and quantize_x_i8 lay them out. 16
// output rows (two blocks), K = 128 in groups of 32; the largest codes and activations included.
template <int M, int R>
void check_int4x8(uint32_t& state) {
  constexpr int N = 16, K = 128, G = 4, gs = 32;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  uint8_t code[N][K];
  int8_t xq[M][K];
  float s[N][G], o[N][G], bias[N], xa[M][K / 32], xs[M][G];
  for (auto& row : code)
    for (uint8_t& c : row) c = next() >> 28;
  for (auto& row : xq)
    for (int8_t& v : row) v = static_cast<int8_t>(static_cast<int>(next() >> 24) % 255 - 127);
  for (int c = 0; c < 32; ++c) { code[0][c] = 15; xq[0][c] = 127; }  // int16 sums at their largest
  for (int n = 0; n < N; ++n) {
    bias[n] = static_cast<float>(next() >> 20) / 4096.f - 128.f;
    for (int g = 0; g < G; ++g) {
      s[n][g] = static_cast<float>(next() >> 8) * 1e-9f;
      o[n][g] = -static_cast<float>(next() >> 8) * 7e-9f;
    }
  }
  for (int m = 0; m < M; ++m) {
    for (float& a : xa[m]) a = static_cast<float>(next() >> 8) * 3e-8f;
    for (float& v : xs[m]) v = static_cast<float>(next() >> 8) * 1e-6f - 8.f;
  }
  // interleave8: block b, chunk c, step t, row j, byte i = row b*8+j's byte 32c + 4t + i (low nibble: the even
  // column); scales and offsets [N / 8, G, 8]; x per 64 columns [even | odd].
  uint8_t w[N / 8][4 * K];
  float sp[N / 8][G][8], op[N / 8][G][8];
  for (int b = 0; b < N / 8; ++b)
    for (int j = 0; j < 8; ++j) {
      const int n = 8 * b + j;
      for (int c = 0; c < K / 64; ++c)
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < 4; ++i) {
            const int col = 64 * c + 2 * (4 * t + i);
            w[b][((c * 8 + t) * 8 + j) * 4 + i] = static_cast<uint8_t>(code[n][col] | code[n][col + 1] << 4);
          }
      for (int g = 0; g < G; ++g) { sp[b][g][j] = s[n][g]; op[b][g][j] = o[n][g]; }
    }
  int8_t xp[M][K];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < K / 64; ++c)
      for (int e = 0; e < 32; ++e) {
        xp[m][64 * c + e] = xq[m][64 * c + 2 * e];
        xp[m][64 * c + 32 + e] = xq[m][64 * c + 2 * e + 1];
      }
  float got[M][N], want[M][N];
  pagoda_i8::blocks_int4x8_i8<M, R, float>(&w[0][0], &sp[0][0][0], &op[0][0][0], bias, &xp[0][0], &xa[0][0],
                                          &xs[0][0], &got[0][0], N, K, G, gs, 0, N / 8);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int h = 0; h < K / 32; ++h) {
        int32_t sum = 0;
        for (int c = 32 * h; c < 32 * h + 32; ++c) sum += code[n][c] * xq[m][c];
        acc = std::fma(static_cast<float>(sum), s[n][h * 32 / gs] * xa[m][h], acc);
      }
      for (int g = 0; g < G; ++g) acc = std::fma(o[n][g], xs[m][g], acc);
      want[m][n] = acc + bias[n];
    }
  char what[48];
  std::snprintf(what, sizeof(what), "int4x8 int8-activation kernel, %d rows", M);
  expect(what, &got[0][0], &want[0][0], M * N);
}
#endif

}  // namespace

int main() {
  uint32_t state = 12345;
  uint8_t codes[256];
  for (uint8_t& c : codes) {
    state = state * 1664525u + 1013904223u;  // an LCG: the same bytes on every ISA
    c = static_cast<uint8_t>(state >> 24);
    if ((c & 0x7F) == 0x7F) c ^= 1;  // no e4m3 NaN
  }
  for (int i = 0; i < 8; ++i) codes[i] = static_cast<uint8_t>(i * 16 + 3);  // e4m3 subnormals and both signs
  float x[8 * 16];
  for (int i = 0; i < 8 * 16; ++i) x[i] = std::ldexp(static_cast<float>((i * 37) % 101) - 50.f, -(i % 7)) + 1e-3f * i;
  std::printf("W=%d\n", W);
  check_format<pagoda_cpu::kInt4>("int4", codes, x);
  check_format<pagoda_cpu::kInt8>("int8", codes, x);
  check_format<pagoda_cpu::kFp8>("fp8", codes, x);
  check_transpose();
  check_bf16_and_exp(x);
  check_half();
  check_gguf<pagoda_gguf::kQ4_K>("Q4_K", state);
  check_gguf<pagoda_gguf::kQ5_K>("Q5_K", state);
  check_gguf<pagoda_gguf::kQ6_K>("Q6_K", state);
  check_gguf<pagoda_gguf::kQ5_0>("Q5_0", state);
  check_gguf<pagoda_gguf::kQ8_0>("Q8_0", state);
#if defined(PAGODA_INT4X8_I8)
  check_int4x8<1, 2>(state);
  check_int4x8<3, 1>(state);
  check_int4x8<pagoda_i8::kRows, 1>(state);
#endif
  return failures ? 1 : 0;
}
