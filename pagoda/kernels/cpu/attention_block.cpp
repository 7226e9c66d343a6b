// One op for a layer's attention after the qkv projection: RoPE on the q and k parts of the fused
// qkv rows (in place), k and v into the paged cache, then paged attention. At decode each of these
// is microseconds of work, and as three ops (plus the split and views between them) each layer paid Python
// and dispatch overhead of the same order; here it is one call.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "ops.h"

namespace pagoda_cpu {

// qkv: [T, (Hq + 2 Hkv) * D]; returns the attention output [T, Hq * D] in qkv's dtype.
at::Tensor rope_cache_attention(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                                int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& k_scale,
                                const c10::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                                const c10::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_cache_attention: qkv must be [T, W] contiguous in W");
  const int64_t T = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(heads > 0 && qkv.size(1) % heads == 0, "rope_cache_attention: qkv width is not (Hq + 2 Hkv) * D");
  const int64_t D = qkv.size(1) / heads;
  rope(qkv, positions, cos, sin, num_heads, num_kv_heads, D);
  const at::Tensor k = qkv.narrow(1, num_heads * D, num_kv_heads * D).view({T, num_kv_heads, D});
  const at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * D, num_kv_heads * D).view({T, num_kv_heads, D});
  write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * D).contiguous().view({T, num_heads, D});
  return paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale,
                         window, softcap, tree_mask)
      .view({T, num_heads * D});
}

}  // namespace pagoda_cpu

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "rope_cache_attention(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
      "float scale, int num_heads, int num_kv_heads, Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None, "
      "int window=0, float softcap=0., Tensor? tree_mask=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("rope_cache_attention", &pagoda_cpu::rope_cache_attention); }
