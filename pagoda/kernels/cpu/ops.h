// Kernels one C++ source calls in another (each file keeps its helpers in an anonymous namespace;
// these are thin exported entry points to the registered ops, same checks and arithmetic).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

namespace pagoda_cpu {

void rope(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
              const c10::optional<at::Tensor>& v_scale);

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                           const c10::optional<at::Tensor>& tree_mask = c10::nullopt);

at::Tensor rope_cache_attention(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                                int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& k_scale,
                                const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                                const c10::optional<at::Tensor>& tree_mask = c10::nullopt);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual);

at::Tensor silu_and_mul(const at::Tensor& x);

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t fmt,
                        int64_t group_size);

// kind: 0 INT4, 1 INT8, 2 FP8 e4m3 (quant_panel_linear.cpp)
at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t group_size, int64_t kind);

// kind: 0 INT4, 1 INT8, 2 FP8 e4m3, in panels of 2W columns (quant_vpanel_linear.cpp: the portable builds)
at::Tensor quant_vpanel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                               int64_t group_size, int64_t kind);

// A GGUF weight's super-blocks in portable panels: data uint8, table int64 [segments, 3] of (GGML type, rows,
// byte offset) (quant_vpanel_linear.cpp, gguf_blocks.h)
at::Tensor gguf_vpanel_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& table,
                              const c10::optional<at::Tensor>& bias, c10::optional<bool> amx = c10::nullopt);

// The same weight times x rounded to int8 per block as llama.cpp rounds it (Q8_K or Q8_0 by segment type), with
// integer dot products (gguf_a8_linear.cpp)
at::Tensor gguf_a8_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& table,
                          const c10::optional<at::Tensor>& bias, bool reference = false);

// Whether this build and CPU run bf16 GGUF segments on AMX tiles (quant_panel_linear.cpp, amx_blocks.h).
bool gguf_amx_available();

// One GGUF segment (GGML type `type`, `rows` output rows in gguf_blocks.h's AVX-512 panels at `data`) times bf16 x
// [M, K] into y (ldy apart, bias from the segment's first row) through the bf16 panel driver, on AMX tiles where
// `amx` (which gguf_amx_available must allow); false where this build has no bf16 decoder for it
// (quant_panel_linear.cpp).
bool gguf_panel_segment(const c10::BFloat16* x, int64_t M, int64_t K, int64_t type, const uint8_t* data,
                        int64_t rows, const float* bias, c10::BFloat16* y, int64_t ldy, bool amx);

// One linear whose weight is held in format `fmt` (linear_formats.h: kDense the weight, kPanels its panels, else the
// codes with their scales and offsets), through that format's few-row kernel (linear_formats.cpp).
at::Tensor format_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                         const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t fmt,
                         int64_t group_size);

// y[t] += B_s A_s x[t] for each token t's adapter slot s (-1: none), in place (lora.cpp).
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
               const at::Tensor& bt, const at::Tensor& widths, const at::Tensor& parts);

}  // namespace pagoda_cpu
