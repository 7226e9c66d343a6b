// y = x @ w^T (+ bias) for a few rows of x (decode: M <= 8), streaming the weight once.
//
// At decode a linear layer is a matrix-vector product bound by memory bandwidth. oneDNN/MKL
// read the weight well below the machine's streaming rate for these shapes, so the weight read
// dominates a step. Here each weight row is loaded once and dotted against all
// M activation rows (AVX-512 FMA for fp32, AVX512-BF16 dot products for bf16), with rows split
// across threads. Built only where the compiler targets those instructions; otherwise the op
// reports "unsupported" and callers use F.linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "dispatch_rows.h"
#include "ops.h"

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxM = 8;

#if defined(__AVX512F__)
// Rows [n0, n1) of the output for M activation rows, fp32.
template <int M>
void rows_f32(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 wv = _mm512_loadu_ps(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + b;
  }
}
#endif

#if defined(__AVX512BF16__)
template <int M>
void rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, c10::BFloat16* y, int64_t K, int64_t N,
               int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    float b = 0.f;
    if (bias) b = static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits()));
    for (int m = 0; m < M; ++m) y[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[m]) + b);
  }
}
#endif

// Mirrors pagoda.kernels.linear.small_m_supported, which callers check first.
bool small_m_linear_supported(int64_t dtype_code, int64_t K) {
  const auto dtype = static_cast<at::ScalarType>(dtype_code);
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return K % 32 == 0;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return K % 16 == 0;
#endif
  (void)dtype;
  (void)K;
  return false;
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "small_m_linear: layout");
  TORCH_CHECK(x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(), "small_m_linear: shape/dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxM, "small_m_linear: 1 <= M <= 8");
  TORCH_CHECK(small_m_linear_supported(static_cast<int64_t>(x.scalar_type()), K), "small_m_linear: unsupported");
  if (bias.has_value()) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "small_m_linear: bias");
  auto y = at::empty({M, N}, x.options());
  // ~64 rows per task keeps both threads streaming long contiguous runs of the weight.
  [[maybe_unused]] constexpr int64_t grain = 64;  // (no kernel in builds without AVX-512)
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
    auto* yp = y.data_ptr<c10::BFloat16>();
    dispatch_m(M, [&](auto mc) {
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_bf16<decltype(mc)::value>(xp, wp, bp, yp, K, N, n0, n1); });
    });
    return y;
  }
#endif
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  dispatch_m(M, [&](auto mc) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_f32<decltype(mc)::value>(xp, wp, bp, yp, K, N, n0, n1); });
  });
#endif
  return y;
}

}  // namespace

namespace pagoda_cpu {
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return ::small_m_linear(x, w, bias);
}
}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("small_m_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("small_m_linear", &small_m_linear); }
