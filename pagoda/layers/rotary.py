"""Rotary position embedding (neox/HF "rotate_half" layout) with the config's theta and scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.kernels.fused_ops import rope_, rope_torch_


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int,
                  max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the `dim` rotary dims and the attention scale factor for cos/sin, per the
    rope_scaling dict. `max_positions` is the config's max_position_embeddings; `max_model_len`, the longest
    context this engine serves (None: max_positions), picks LongRoPE's factor set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
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
    if kind == "longrope":
        return _longrope(inv_freq, scaling, max_positions, max_model_len)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, longrope)")


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_positions: int,
              max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (transformers' _compute_longrope_parameters): each frequency i is divided by its own
    rescale factor, short_factor[i] or long_factor[i], and cos/sin are scaled by sqrt(1 + ln s / ln L) with
    L = original_max_position_embeddings and s = max_position_embeddings / L (or the dict's factor / attention_factor).

    Which set: transformers switches per sequence, short while the sequence has at most L tokens and long past
    that, recomputing the whole KV cache when a sequence crosses L (Phi3ForCausalLM.prepare_inputs_for_generation).
    A paged KV cache shared between sequences (prefix caching) cannot hold both, so the set is chosen once per
    engine, as vLLM and llama.cpp do: long when max_model_len > L, short otherwise. Every sequence on the same side
    of L as max_model_len then equals transformers; serving Phi-3-128k with max_model_len <= 4096 gives the short
    set that transformers uses for short prompts."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / orig)
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    sets = {}
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor([float(f) for f in scaling[key]], dtype=torch.float64)
        if ext.shape != inv_freq.shape:
            raise ValueError(f"longrope {key} has {ext.numel()} values; the rotary dims need {inv_freq.numel()}")
        sets[key] = ext
    long = (max_model_len or max_positions) > orig
    return inv_freq / sets["long_factor" if long else "short_factor"], float(mscale)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, rotary_dim / 2] indexed by absolute position. A head's dims past
    rotary_dim pass through unrotated (partial rotary: Phi-4-mini rotates 3/4 of each head)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self._table_args = (self.rotary_dim, max_positions, theta, scaling, max_model_len)
        cos, sin = _tables(*self._table_args)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.op = rope_

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernel (`cpp`: its KernelPolicy's choice) or torch's twin."""
        self.op = rope_ if cpp else rope_torch_

    def materialize(self, device: torch.device) -> None:
        """Build the tables on `device` (a model made on the meta device has none: they are not weights)."""
        cos, sin = _tables(*self._table_args)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward_(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        """Rotate the q and k parts of fused qkv rows [T, (Hq+2Hkv)*D] in place."""
        self.op(qkv, positions, self.cos, self.sin, num_heads, num_kv_heads, head_dim)


def _tables(dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
            max_model_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, mscale = rope_inv_freq(dim, theta, scaling, max_positions, max_model_len)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return (freqs.cos() * mscale).float(), (freqs.sin() * mscale).float()
