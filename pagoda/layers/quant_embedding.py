"""Token embedding over a quantized table (GGUF Q8_0 / Q4): gathers the rows a batch needs and
dequantizes only those, so the table stays packed (and can be shared with a tied lm_head)."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.quant_linear import PackedWeight


class QuantEmbedding(nn.Module):
    def __init__(self, pw: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.pw = pw
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = pw.out_features, pw.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pw.dequantize_rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        pw = self.pw
        return (f"{self.num_embeddings}, {self.embedding_dim}, format={pw.format}, layout={pw.layout}, "
                f"group={pw.group_size}")
