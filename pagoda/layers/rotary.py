"""Rotary position embedding (neox/HF "rotate_half" layout) with the config's theta and scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.kernels.fused_ops import rope_


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scale factor for cos/sin, per the rope_scaling dict."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq, mscale = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", (freqs.cos() * mscale).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * mscale).float(), persistent=False)
        self.kernel: bool | None = None  # set by the model's prepare()

    def forward_(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        """Rotate the q and k parts of fused qkv rows [T, (Hq+2Hkv)*D] in place."""
        rope_(qkv, positions, self.cos, self.sin, num_heads, num_kv_heads, head_dim, self.kernel)
