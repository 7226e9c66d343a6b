// The decoder layers of a Llama-family model as one op, for steps of a few rows (decode).
//
// At decode each op of a layer is microseconds of work, and from Python a layer is eight op calls
// (two norms, four linears, attention, SiLU), each paying the interpreter and the dispatcher, a cost of
// the same order as the work. Here the same kernels run back to back in C++, so a step pays that once. Every kernel is the one the Python path calls (ops.h), so the output is bit-identical.
//
// Per layer l: norms[2l], norms[2l+1] are the input and post-attention RMSNorm weights; linears
// holds qkv, o, gate_up, down in that order, each as four entries (weight or codes, scales, offsets,
// bias); formats[4l + i] is its LinearFormat (linear_formats.h), with group_sizes[4l + i] its group size.
// qk_norms is empty, or holds each layer's q and k head norm weights (Qwen3: RMSNorm over each head of q
// and k before RoPE), 2l and 2l + 1. windows is empty, or holds each layer's sliding window (0: global).
// With lora_slots (each token's adapter slot, -1: none), lora holds four entries per linear in the same order
// (A, B^T, widths, parts: lora.cpp), or none where that linear has no adapters; each linear's output then gets its
// tokens' adapter updates, as the layer-by-layer path adds them (lora/layer.py).
// With aux_out [T, len(aux_layers) * H], the residual stream entering each layer aux_layers[j] (EAGLE-3's captured
// states) is copied into its columns [j * H, (j + 1) * H): the sum the fused norm stores, the same bits as the
// layer-by-layer path's x + residual.

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "ops.h"

namespace {

constexpr int64_t kLinearsPerLayer = 4, kEntriesPerLinear = 4;

// RMSNorm over each head of the `num` heads starting at head `first` of the fused qkv rows, in place: the
// same kernel on the same contiguous rows as the model's layer-by-layer path (LlamaAttention._norm_heads).
void norm_heads(at::Tensor& qkv, const at::Tensor& weight, double eps, int64_t first, int64_t num, int64_t D) {
  at::Tensor cols = qkv.narrow(1, first * D, num * D);
  cols.copy_(pagoda_cpu::rms_norm(cols.reshape({-1, D}), weight, eps, c10::nullopt).view({qkv.size(0), num * D}));
}

at::Tensor run_linear(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& linears, int64_t index,
                      int64_t fmt, int64_t group_size) {
  const int64_t base = index * kEntriesPerLinear;
  const c10::optional<at::Tensor> w = linears.get(base), scales = linears.get(base + 1),
                                  offsets = linears.get(base + 2), bias = linears.get(base + 3);
  TORCH_CHECK(w.has_value(), "decoder_stack: linear ", index, " has no weight");
  return pagoda_cpu::format_linear(x, *w, scales, offsets, bias, fmt, group_size);
}

constexpr int64_t kLoRAEntries = 4;

void add_lora(at::Tensor& y, const at::Tensor& x, const c10::optional<at::Tensor>& lora_slots,
              const c10::List<c10::optional<at::Tensor>>& lora, int64_t index) {
  if (!lora_slots.has_value()) return;
  const int64_t base = index * kLoRAEntries;
  const c10::optional<at::Tensor> a = lora.get(base), bt = lora.get(base + 1), widths = lora.get(base + 2),
                                  parts = lora.get(base + 3);
  if (a.has_value()) pagoda_cpu::lora_add_(y, x, *lora_slots, *a, *bt, *widths, *parts);
}

// Returns (h, residual): the last layer's output and the running residual, for the final norm.
std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, at::TensorList k_caches, at::TensorList v_caches,
    const c10::List<c10::optional<at::Tensor>>& k_scales, const c10::List<c10::optional<at::Tensor>>& v_scales,
    at::TensorList norms, const c10::List<c10::optional<at::Tensor>>& qk_norms,
    const c10::List<c10::optional<at::Tensor>>& linears, at::IntArrayRef formats,
    at::IntArrayRef group_sizes, at::IntArrayRef windows, double eps, double scale, int64_t num_heads,
    int64_t num_kv_heads, int64_t num_layers, const c10::optional<at::Tensor>& lora_slots,
    const c10::List<c10::optional<at::Tensor>>& lora, const c10::optional<at::Tensor>& tree_mask,
    at::IntArrayRef aux_layers, const c10::optional<at::Tensor>& aux_out) {
  const int64_t L = num_layers;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_stack: x must be [T, H] contiguous");
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(k_caches.size()) >= L && static_cast<int64_t>(v_caches.size()) >= L &&
                  static_cast<int64_t>(k_scales.size()) >= L && static_cast<int64_t>(v_scales.size()) >= L &&
                  static_cast<int64_t>(norms.size()) >= 2 * L &&
                  static_cast<int64_t>(linears.size()) >= L * kLinearsPerLayer * kEntriesPerLinear &&
                  static_cast<int64_t>(formats.size()) >= L * kLinearsPerLayer &&
                  static_cast<int64_t>(group_sizes.size()) >= L * kLinearsPerLayer,
              "decoder_stack: per-layer lists are shorter than num_layers");
  const bool qk = qk_norms.size() > 0;
  TORCH_CHECK(!qk || static_cast<int64_t>(qk_norms.size()) >= 2 * L, "decoder_stack: qk_norms is shorter than 2 per layer");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) >= L, "decoder_stack: windows is shorter than L");
  TORCH_CHECK(!lora_slots.has_value() || static_cast<int64_t>(lora.size()) >= L * kLinearsPerLayer * kLoRAEntries,
              "decoder_stack: lora is shorter than 4 entries per linear");
  const int64_t H = x.size(1);
  TORCH_CHECK(!aux_out.has_value() || (aux_out->dim() == 2 && aux_out->size(0) == x.size(0) &&
                                       aux_out->size(1) == static_cast<int64_t>(aux_layers.size()) * H &&
                                       aux_out->scalar_type() == x.scalar_type()),
              "decoder_stack: aux_out must be [T, len(aux_layers) * H] in x's dtype");
  at::Tensor h = x, residual;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t li = l * kLinearsPerLayer;
    at::Tensor a;
    if (l == 0) {
      residual = x.clone();
      a = pagoda_cpu::rms_norm(h, norms[0], eps, c10::nullopt);
    } else {
      a = pagoda_cpu::rms_norm(h, norms[2 * l], eps, residual);  // residual += h: the stream entering layer l
    }
    if (aux_out.has_value())
      for (size_t j = 0; j < aux_layers.size(); ++j)
        if (aux_layers[j] == l) aux_out->narrow(1, static_cast<int64_t>(j) * H, H).copy_(residual);
    at::Tensor qkv = run_linear(a, linears, li, formats[li], group_sizes[li]);
    add_lora(qkv, a, lora_slots, lora, li);
    if (qk) {
      const int64_t hd = qkv.size(1) / (num_heads + 2 * num_kv_heads);
      norm_heads(qkv, *qk_norms.get(2 * l), eps, 0, num_heads, hd);
      norm_heads(qkv, *qk_norms.get(2 * l + 1), eps, num_heads, num_kv_heads, hd);
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    a = pagoda_cpu::rope_cache_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                         query_start_loc, seq_lens, scale, num_heads, num_kv_heads, k_scales.get(l),
                                         v_scales.get(l), windows.empty() ? 0 : windows[l], 0., tree_mask);
    at::Tensor y = run_linear(a, linears, li + 1, formats[li + 1], group_sizes[li + 1]);
    add_lora(y, a, lora_slots, lora, li + 1);
    a = pagoda_cpu::rms_norm(y, norms[2 * l + 1], eps, residual);
    y = run_linear(a, linears, li + 2, formats[li + 2], group_sizes[li + 2]);
    add_lora(y, a, lora_slots, lora, li + 2);
    a = pagoda_cpu::silu_and_mul(y);
    h = run_linear(a, linears, li + 3, formats[li + 3], group_sizes[li + 3]);
    add_lora(h, a, lora_slots, lora, li + 3);
  }
  return {h, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor(c!)?[] k_scales, Tensor(d!)?[] v_scales, Tensor[] norms, Tensor?[] qk_norms, Tensor?[] linears, "
      "int[] formats, "
      "int[] group_sizes, int[] windows, float eps, float scale, int num_heads, int num_kv_heads, int num_layers, "
      "Tensor? lora_slots, Tensor?[] lora, Tensor? tree_mask=None, int[] aux_layers=[], Tensor(e!)? aux_out=None) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
