"""Attention over the paged KV cache: write this step's K/V into the pool, then read through block tables."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.fused_ops import write_kv_cache, write_kv_cache_torch
from pagoda.kernels.paged_attention import (
    AttentionMetadata,
    fused_attention_supported,
    paged_attention,
    paged_attention_reference,
)
from pagoda.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 softcap: float | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = sliding_window or 0  # a query at p sees keys (p - window, p]; 0: every key before it
        self.softcap = softcap or 0.0      # scores capped as softcap * tanh(s / softcap) (Gemma 2); 0: none
        # Bound by the model runner to this layer's slice of the block pool.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Per (block, kv head, slot) fp32 scales when the pool is 8-bit (kv_cache_dtype int8/fp8), else None.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # RoPE, the cache write and attention as one C++ op (bind_ops), else the three ops below.
        self.fused = False
        self.write_kv, self.attend = write_kv_cache, paged_attention

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernels (`cpp`: its KernelPolicy's choice) or torch's twins."""
        self.fused = cpp
        self.write_kv, self.attend = (write_kv_cache, paged_attention) if cpp else \
            (write_kv_cache_torch, paged_attention_reference)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    rope: RotaryEmbedding) -> torch.Tensor:
        """Fused qkv rows [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]: RoPE, the cache write and attention, in
        one C++ call where the kernels take these tensors (kernels/cpu/attention_block.cpp)."""
        if self.fused and fused_attention_supported(qkv, self.k_cache, self.k_scale is not None):
            return torch.ops.pagoda.rope_cache_attention(
                qkv, positions, rope.cos, rope.sin, self.k_cache, self.v_cache, meta.slot_mapping,
                meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale, self.num_heads,
                self.num_kv_heads, self.k_scale, self.v_scale, self.window, self.softcap, meta.tree_mask)
        T, D = qkv.shape[0], self.head_dim
        rope.forward_(positions, qkv, self.num_heads, self.num_kv_heads, D)
        q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        return self.forward(q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D), meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq*D]."""
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        self.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.attend(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                          self.scale, self.k_scale, self.v_scale, self.window, self.softcap, meta.tree_mask)
        return out.reshape(q.shape[0], -1)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
