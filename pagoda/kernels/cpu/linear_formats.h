// The formats of a linear layer's weight as the kernels take them: ONE table for C++ and Python
// (pagoda/kernels/linear_formats.py reads this enum at import, so a new format is added here only).
// format_linear (linear_formats.cpp) dispatches on it for the decoder stack and the MoE experts;
// quant_linear.cpp takes kInt4..kInt4a8; quant_panel_linear.cpp takes kInt4p..kFp8p as its kind (format - kInt4p),
// quant_vpanel_linear.cpp kInt4v..kFp8v (format - kInt4v), kGgufV and kGgufA as gguf_vpanel_linear, kGgufI8 as gguf_a8_linear.
#pragma once

#include <cstdint>

namespace pagoda_cpu {

enum LinearFormat : int64_t {
  kDense = -1,   // a float weight [N, K], small_m_linear
  kPanels = -2,  // a float weight in panels of 16 output columns, packed_linear
  kInt4 = 0,     // INT4 codes, row-major, groups along K
  kInt8 = 1,     // INT8 codes, row-major
  kFp8 = 2,      // FP8 e4m3 codes, row-major
  kInt4x8 = 3,   // INT4 in blocks of 8 interleaved rows, INT8 activations (VNNI, AVX2 vpmaddubsw, Arm sdot)
  kInt4a8 = 4,   // INT4 row-major (as kInt4), INT8 activations (AVX2 vpmaddubsw; the shapes kInt4x8 cannot take)
  kInt4p = 5,    // INT4 in panels of 16 output columns
  kInt8p = 6,    // INT8 in panels, one byte a code
  kFp8p = 7,     // FP8 in panels
  kInt4v = 8,    // INT4 in portable panels of 2W columns (simd.h's W: the build's vector width)
  kInt8v = 9,    // INT8 in portable panels
  kFp8v = 10,    // FP8 in portable panels
  kGguf = 11,    // GGUF super-blocks as stored, row-major (no kernel reads them: prepared as kGgufV)
  kGgufV = 12,   // GGUF blocks (K-quants, 32-weight types) in portable panels (gguf_blocks.h)
  kGgufA = 13,   // the same panels on AMX tiles, bf16 activations (amx_blocks.h)
  kGgufI8 = 14,  // the same panels times int8 activations, rounded as llama.cpp rounds them (gguf_a8_linear.cpp)
};

}  // namespace pagoda_cpu
