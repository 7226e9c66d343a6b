"""Reference computations the kernels' tests compare against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_sdpa(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], qsl: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Ground truth for paged attention: each sequence's queries (q[qsl[b]:qsl[b+1]], the last of its keys)
    over its dense keys and values ks[b], vs[b] [S, Hkv, D], through torch's SDPA with an explicit
    bottom-right-aligned causal mask, in fp32."""
    outs = []
    for b in range(len(ks)):
        qb = q[qsl[b]:qsl[b + 1]].float().transpose(0, 1)  # [Hq, q_len, D]
        k, v = ks[b].float().transpose(0, 1), vs[b].float().transpose(0, 1)
        q_len, s = qb.shape[1], k.shape[1]
        mask = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
        outs.append(F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)
