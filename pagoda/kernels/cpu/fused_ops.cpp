// Small fused ops for the per-layer hot path on CPU. At decode (a few tokens per step)
// each layer's elementwise work is tiny, and the cost is op count: RMSNorm alone is six
// aten ops, RoPE about ten. One op each here cuts a 30-layer step by ~1000 dispatches.
//
// All ops compute in fp32 and store in the tensor's dtype (fp32 or bf16), W lanes at a time (simd.h: the same
// source for AVX-512, AVX2 and NEON) with scalar tails.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include <cstdint>
#include <cstring>

#include "ops.h"
#include "vec_bf16.h"

namespace {

using pagoda_simd::hmax;
using pagoda_simd::hsum;
using pagoda_simd::vexp;
using pagoda_simd::vf;
using pagoda_simd::vfma;
using pagoda_simd::vload;
using pagoda_simd::vload_as;
using pagoda_simd::vround_as;
using pagoda_simd::vsplat;
using pagoda_simd::vstore;
using pagoda_simd::vstore_as;
using pagoda_simd::vu;
using pagoda_simd::W;

template <typename T>
inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }
template <typename T>
inline void st(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

// The vector loads and stores (vec_bf16.h) take fp32 or a 16-bit bf16: no other instantiation.
#define DISPATCH_FP32_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Rows are processed in parallel only when there are enough of them to pay for it.
constexpr int64_t kGrain = 16;

// One row: (residual += x, then) out = w * T(v * inv_rms(v)), v the stored row, rounded like the unfused ops.
template <typename T>
void rms_norm_row(const T* xr, T* orow, T* rr, const T* w, int64_t dim, float eps) {
  const T* v = rr ? rr : xr;
  int64_t i = 0;
  vf acc{};
  for (; i + W <= dim; i += W) {
    vf x = vload_as(xr + i);
    if (rr) x = vstore_as(rr + i, vload_as(rr + i) + x);  // the sum as stored
    acc = vfma(x, x, acc);
  }
  float sumsq = hsum(acc);
  for (; i < dim; ++i) {
    if (rr) st(rr, i, ld(rr, i) + ld(xr, i));
    const float x = ld(v, i);
    sumsq += x * x;
  }
  const float inv = 1.f / std::sqrt(sumsq / dim + eps);
  for (i = 0; i + W <= dim; i += W) vstore_as(orow + i, vload_as(w + i) * vround_as<T>(vload_as(v + i) * inv));
  for (; i < dim; ++i) st(orow, i, ld(w, i) * static_cast<float>(static_cast<T>(ld(v, i) * inv)));
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, T* residual, int64_t res_stride,
                   const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      rms_norm_row(x + r * x_stride, out + r * out_stride, residual ? residual + r * res_stride : nullptr, w, dim, eps);
  });
}

// out = rms_norm(x) * w; when residual is given: residual += x first, and x's norm is of the sum.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                        const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with a contiguous last dim");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype/layout");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), dim = x.size(1);
  DISPATCH_FP32_BF16(x.scalar_type(), "rms_norm", [&] {
    scalar_t* res = nullptr;
    int64_t res_stride = 0;
    if (residual.has_value()) {
      TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->stride(1) == 1, "rms_norm: residual");
      res = residual->data_ptr<scalar_t>();
      res_stride = residual->stride(0);
    }
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), dim, res, res_stride,
                            weight.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return out;
}

// The q and k heads of one row (contiguous in it), rotated by one position's table row c, s. The sizes are
// arguments, not the caller's captures: the vector stores (memcpy) may alias any memory, and a size read through
// a reference would be reloaded after every store.
template <typename T>
void rope_row(T* row, const float* c, const float* s, int64_t heads, int64_t head_dim, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x = row + h * head_dim;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const vf x1 = vload_as(x + i), x2 = vload_as(x + i + half), cv = vload(c + i), sv = vload(s + i);
      vstore_as(x + i, x1 * cv - x2 * sv);
      vstore_as(x + i + half, x2 * cv + x1 * sv);
    }
    for (; i < half; ++i) {
      const float x1 = ld(x, i), x2 = ld(x, i + half);
      st(x, i, x1 * c[i] - x2 * s[i]);
      st(x, i + half, x2 * c[i] + x1 * s[i]);
    }
  }
}

// In-place rotary embedding (rotate-half layout) on the q and k heads of a fused qkv row.
// qkv: [T, (Hq + 2*Hkv) * D]; cos/sin: fp32 [max_pos, R/2]; positions: int64 [T]. The table's width sets the
// rotary dims R: the first R of each head rotate (pairs i, i + R/2), the other D - R pass through (partial
// rotary, Phi-4-mini); R = D for most models.
void rope_cpu(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope: qkv must be [T, W] contiguous in W");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rope: positions int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "rope: cos/sin fp32");
  TORCH_CHECK(cos.dim() == 2 && 2 * cos.size(1) <= head_dim, "rope: cos/sin must be [max_pos, R/2] with R <= head_dim");
  const int64_t T = qkv.size(0), half = cos.size(1), heads = num_heads + num_kv_heads, stride = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  DISPATCH_FP32_BF16(qkv.scalar_type(), "rope", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        rope_row(base + t * stride, cp + pos[t] * half, sp + pos[t] * half, heads, head_dim, half);
    });
  });
}

// silu(gate) * up, with x = [gate | up] along the last dim: [T, 2I] -> [T, I].
// One row of silu(gate) * up; silu(gate) is rounded to the dtype first, as the unfused
// F.silu(gate) * up does. (NaN inputs are not expected here: the row comes from a matmul.)
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
  for (; i + W <= I; i += W) {
    const vf gv = vload_as(g + i);
    vstore_as(o + i, vround_as<T>(gv / (1.f + vexp(-gv))) * vload_as(u + i));
  }
  for (; i < I; ++i) {
    const float gv = ld(g, i);
    const float sv = static_cast<float>(static_cast<T>(gv / (1.f + std::exp(-gv))));
    st(o, i, sv * ld(u, i));
  }
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({T, I}, x.options());
  DISPATCH_FP32_BF16(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, T, kGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) silu_mul_row(in + t * xs, in + t * xs + I, o + t * I, I);
    });
  });
  return out;
}

// Quantize one row of D values into an 8-bit cache row with its own scale = amax / qmax
// (pagoda/kernels/kv_quant.py holds the torch twin; both divide in fp32, round to nearest even
// and clamp to +-qmax, so they store the same bytes).
template <typename S>
void quantize_row(const S* x, int64_t D, at::ScalarType fmt, uint8_t* dst, float* scale_out) {
  const float qmax = fmt == at::kChar ? 127.f : fmt == at::kFloat8_e4m3fn ? 448.f : 57344.f;
  // amax and the scaled, clamped values W lanes at a time; ?: as std::max and std::min compare, so a NaN is
  // skipped by amax and kept by the clamp on every ISA, as in the scalar tail.
  int64_t d = 0;
  vf m{};
  for (; d + W <= D; d += W) {
    const vf a = (vf)((vu)vload_as(x + d) & 0x7FFFFFFFu);
    m = m < a ? a : m;
  }
  float amax = hmax(m);
  for (; d < D; ++d) amax = std::max(amax, std::fabs(ld(x, d)));
  const float scale = amax / qmax;
  const float safe = scale > 0.f ? scale : 1.f;  // an all-zero row stores zeros
  auto put = [&](int64_t i, float y) {
    if (fmt == at::kChar) dst[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    else if (fmt == at::kFloat8_e4m3fn) dst[i] = c10::Float8_e4m3fn(y).x;
    else dst[i] = c10::Float8_e5m2(y).x;
  };
  float y[W];
  for (d = 0; d + W <= D; d += W) {
    vf v = vload_as(x + d) / safe;
    v = v < -qmax ? vsplat(-qmax) : v;
    vstore(y, qmax < v ? vsplat(qmax) : v);
    for (int l = 0; l < W; ++l) put(d + l, y[l]);
  }
  for (; d < D; ++d) put(d, std::min(std::max(ld(x, d) / safe, -qmax), qmax));
  *scale_out = scale;
}

// Write each token's K and V (read from the fused qkv row) into its cache slot.
// k_cache/v_cache: [num_blocks, Hkv, block_size, D]; slot = block * block_size + offset. A bf16 K cache may
// be stored as words, [num_blocks, Hkv, D/2, block_size, 2] (paged_attention.cpp says why).
// With k_scale/v_scale ([num_blocks, Hkv, block_size] fp32) the caches are 8-bit (int8 or fp8)
// and each (token, head) row is quantized on the way in.
void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
                  const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "write_kv: k, v must be [T, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "write_kv: slots int64");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "write_kv: k and v dtypes differ");
  const bool k_words = k_cache.dim() == 5;
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), bs = v_cache.size(2);
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.size(1) == H && v_cache.size(3) == D, "write_kv: v_cache must be [N, Hkv, bs, D]");
  TORCH_CHECK(!k_words || (k_cache.scalar_type() == at::kBFloat16 && !k_scale.has_value() && k_cache.size(2) * 2 == D &&
                           k_cache.size(3) == bs && k_cache.size(4) == 2),
              "write_kv: K words must be bf16 [num_blocks, Hkv, D/2, block_size, 2]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (k_scale.has_value()) {
    TORCH_CHECK(v_scale.has_value(), "write_kv: k_scale without v_scale");
    const at::ScalarType fmt = k_cache.scalar_type();
    TORCH_CHECK(fmt == at::kChar || fmt == at::kFloat8_e4m3fn || fmt == at::kFloat8_e5m2,
                "write_kv: scales need an int8/fp8 cache, got ", fmt);
    TORCH_CHECK(v_cache.scalar_type() == fmt, "write_kv: k/v cache dtypes differ");
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == k_cache.numel() / D,
                  "write_kv: scales must be fp32 [num_blocks, Hkv, block_size]");
    uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
    uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
    float* ks = k_scale->data_ptr<float>();
    float* vs = v_scale->data_ptr<float>();
    DISPATCH_FP32_BF16(k.scalar_type(), "write_kv_quant", [&] {
      const scalar_t* kp = k.data_ptr<scalar_t>();
      const scalar_t* vp = v.data_ptr<scalar_t>();
      at::parallel_for(0, T * H, kGrain, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t t = i / H, h = i % H;
          const int64_t row = (slots[t] / bs * H + h) * bs + slots[t] % bs;
          quantize_row(kp + t * k.stride(0) + h * k.stride(1), D, fmt, kc + row * D, ks + row);
          quantize_row(vp + t * v.stride(0) + h * v.stride(1), D, fmt, vc + row * D, vs + row);
        }
      });
    });
    return;
  }
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type(), "write_kv: dtype mismatch");
  const size_t row_bytes = D * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = slots[t] / bs, off = slots[t] % bs;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t dst = ((blk * H + h) * bs + off) * D * es;
      const char* ksrc = kp + (t * k.stride(0) + h * k.stride(1)) * es;
      if (k_words) {  // word d2 of this key sits at [blk, h, d2, off]: block_size words apart
        uint32_t* kw = reinterpret_cast<uint32_t*>(kc + (blk * H + h) * bs * D * es) + off;
        for (int64_t d2 = 0; d2 < D / 2; ++d2) std::memcpy(kw + d2 * bs, ksrc + d2 * 4, 4);
      } else {
        std::memcpy(kc + dst, ksrc, row_bytes);
      }
      std::memcpy(vc + dst, vp + (t * v.stride(0) + h * v.stride(1)) * es, row_bytes);
    }
  }
}

// Copy single token slots (src -> dst, in order) in each paged cache: a verified draft tree's accepted nodes
// to the slots of their positions. moves: int64 [M, 2] of slot numbers (block * block_size + offset). A cache is
// [blocks, Hkv, block_size, ...] (V, K as rows, an 8-bit pool's scales) or [blocks, Hkv, D/2, block_size, 2]
// (K as words), contiguous: per block and head, A runs of B elements each hold the slot's values.
void move_kv_slots_cpu(at::TensorList caches, const at::Tensor& moves) {
  TORCH_CHECK(moves.scalar_type() == at::kLong && moves.dim() == 2 && moves.size(1) == 2 && moves.is_contiguous(),
              "move_kv_slots: moves must be int64 [M, 2]");
  const int64_t* mv = moves.data_ptr<int64_t>();
  const int64_t M = moves.size(0);
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.is_contiguous() && c.dim() >= 3 && c.dim() <= 5, "move_kv_slots: caches must be contiguous, 3-5 dims");
    const int64_t slot_dim = c.dim() == 5 ? 3 : 2;
    const int64_t bs = c.size(slot_dim), H = c.size(1), n = c.size(0);
    int64_t A = 1, B = c.element_size();
    for (int64_t d = 2; d < slot_dim; ++d) A *= c.size(d);
    for (int64_t d = slot_dim + 1; d < c.dim(); ++d) B *= c.size(d);
    char* base = static_cast<char*>(c.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t s = mv[2 * m], d = mv[2 * m + 1];
      TORCH_CHECK(s >= 0 && d >= 0 && s / bs < n && d / bs < n, "move_kv_slots: slot out of range");
      for (int64_t h = 0; h < H; ++h)
        for (int64_t a = 0; a < A; ++a) {
          const int64_t run = ((h * A) + a) * bs;  // the run's first slot within its block
          std::memcpy(base + (((d / bs) * H * A * bs) + run + d % bs) * B,
                      base + (((s / bs) * H * A * bs) + run + s % bs) * B, B);
        }
    }
  }
}

}  // namespace

namespace pagoda_cpu {
void rope(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  rope_cpu(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim);
}
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
              const c10::optional<at::Tensor>& v_scale) {
  write_kv_cpu(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual) {
  return rms_norm_cpu(x, weight, eps, residual);
}
at::Tensor silu_and_mul(const at::Tensor& x) { return silu_and_mul_cpu(x); }
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def("move_kv_slots_(Tensor(a!)[] caches, Tensor moves) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rope_", &rope_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
  m.impl("write_kv_", &write_kv_cpu);
  m.impl("move_kv_slots_", &move_kv_slots_cpu);
}
