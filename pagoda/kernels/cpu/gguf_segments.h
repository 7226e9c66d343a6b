// A GGUF weight's segments as the kernels receive them (PackedWeight format "gguf", kernels/gguf_blocks.py): each
// driver walks them through for_segments.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace pagoda_gguf {

// The output rows of a segment table int64 [S, 3] (below), summed on the host: an ATen reduction per call would
// cost more than a decode step's small linears.
inline int64_t segment_rows(const at::Tensor& table) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(),
              "gguf panels: table int64 [segments, 3]");
  const auto* t = table.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t s = 0; s < table.size(0); ++s) rows += t[3 * s + 1];
  return rows;
}

// A GGUF weight's segments (gguf_blocks.h): table int64 [S, 3] of (GGML type, output rows, byte offset into data),
// checked against the data's size; fn(Blocks<T>, first output row, rows) per segment.
template <typename Fn>
inline void for_segments(const at::Tensor& data, const at::Tensor& table, int64_t K, Fn&& fn) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(), "gguf panels: data uint8 [bytes]");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(),
              "gguf panels: table int64 [segments, 3]");
  const auto* t = table.data_ptr<int64_t>();
  const auto* base = data.data_ptr<uint8_t>();
  int64_t row0 = 0;
  for (int64_t s = 0; s < table.size(0); ++s) {
    const int64_t type = t[3 * s], rows = t[3 * s + 1], offset = t[3 * s + 2];
    const bool known = dispatch_type(type, [&](auto c) {
      using B = Blocks<decltype(c)::value>;
      TORCH_CHECK(K % B::Tr::kBlock == 0 && rows % P == 0, "gguf panels: segment ", s, " of GGML type ", type,
                  " takes K a multiple of ", B::Tr::kBlock, " and rows of ", P, ", not K ", K, ", ", rows, " rows");
      TORCH_CHECK(offset >= 0 && offset + rows / P * B::panel_bytes(K) <= data.numel(), "gguf panels: segment ", s,
                  " runs past the data");
      fn(B(base + offset, K), row0, rows);
    });
    TORCH_CHECK(known, "gguf panels: GGML type ", type, " is not in gguf_blocks.h's table");
    row0 += rows;
  }
}

}  // namespace pagoda_gguf
