// The one dispatch on a linear's format code (linear_formats.h): which kernel runs a weight held in that
// format. The decoder stack (decoder_stack.cpp) and the MoE experts (moe.cpp) both call it, so a format
// added to the table is wired up here once.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "linear_formats.h"
#include "ops.h"

namespace pagoda_cpu {

at::Tensor format_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                         const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t fmt,
                         int64_t group_size) {
  if (fmt == kDense) return small_m_linear(x, w, bias);
  if (fmt == kPanels) return packed_linear(x, w, bias);
  TORCH_CHECK(scales.has_value(), "format_linear: a quantized weight (format ", fmt, ") needs its scales");
  if (fmt == kGgufI8) return gguf_a8_linear(x, w, *scales, bias);  // scales: the segment table
  if (fmt == kGgufV || fmt == kGgufA) return gguf_vpanel_linear(x, w, *scales, bias, fmt == kGgufA);  // scales: the segment table
  if (fmt >= kInt4p && fmt <= kFp8p) return quant_panel_linear(x, w, *scales, offsets, bias, group_size, fmt - kInt4p);
  if (fmt >= kInt4v && fmt <= kFp8v) return quant_vpanel_linear(x, w, *scales, offsets, bias, group_size, fmt - kInt4v);
  TORCH_CHECK(fmt >= kInt4 && fmt <= kInt4a8, "format_linear: unknown format ", fmt);
  return quant_linear(x, w, *scales, offsets, bias, fmt, group_size);
}

}  // namespace pagoda_cpu
