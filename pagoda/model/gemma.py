"""Gemma 2 and Gemma 3 text models (Gemma2ForCausalLM, Gemma3ForCausalLM) over a flat varlen batch.

Llama's layers (fused q|k|v and gate|up, paged attention, weight loading) with Gemma's differences:
- RMSNorm scales by (1 + w), and each layer has four: input, post-attention (on the attention output,
  before the residual add), pre-feed-forward and post-feed-forward;
- the embedding is scaled by sqrt(hidden_size), rounded to the compute dtype as transformers does;
- the MLP is gelu(gate, tanh approximation) * up;
- attention scores scale by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps them (attn_logit_softcapping)
  and the logits (final_logit_softcapping): cap * tanh(x / cap);
- sliding-window layers interleave with global ones (ModelArgs.layer_windows: Gemma 2 every other layer,
  Gemma 3 five local to one global); Gemma 3's local layers take their own RoPE base (rope_local_base_freq)
  and its global layers rope_theta with the config's rope scaling; Gemma 3 normalizes each q and k head.
The C++ decoder stack runs Llama's layer only: Gemma runs layer by layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.decoder_stack import DecoderStack
from pagoda.kernels.paged_attention import AttentionMetadata
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.attention import PagedAttention
from pagoda.layers.linear import Linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.model.args import ModelArgs
from pagoda.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagoda.model.llama import weight_shapes as llama_weight_shapes

# transformers' hidden_activation names (activations.ACT2CLS) -> F.gelu's `approximate`.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class GemmaArgs:
    """The Gemma facts beyond ModelArgs, with transformers' defaults for a key a config leaves out."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    rope_local_theta: float | None  # Gemma 3's local (sliding-window) layers; None: every layer uses rope_theta
    gelu_approximate: str

    @classmethod
    def from_args(cls, a: ModelArgs) -> GemmaArgs:
        cfg = a.hf_config
        gemma2 = a.architecture == "Gemma2ForCausalLM"
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{a.architecture} with use_bidirectional_attention (an embedding model) is not "
                             "supported: Pagoda serves causal language models")
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers' Gemma ignores hidden_act
        if act not in _GELU:
            raise ValueError(f"bad config value: hidden_activation = {act!r} (supported: {', '.join(_GELU)})")
        softcaps = {key: cfg.get(key, default if gemma2 else None)  # Gemma2Config's defaults: 50 and 30
                    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
        return cls(query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar", 256),
                   attn_logit_softcapping=_positive_or_none(softcaps, "attn_logit_softcapping"),
                   final_logit_softcapping=_positive_or_none(softcaps, "final_logit_softcapping"),
                   rope_local_theta=None if gemma2 else _local_rope_theta(cfg),
                   gelu_approximate=_GELU[act])


def _local_rope_theta(cfg: dict[str, Any]) -> float:
    """Gemma 3's local RoPE base: rope_parameters["sliding_attention"] (transformers >= 5) or
    rope_local_base_freq (older configs), 10000 by default."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"bad config value: rope_parameters.sliding_attention.rope_type = "
                             f"{local['rope_type']!r} (Gemma 3's local layers use default RoPE)")
        return _positive(local, "rope_theta", 10000.0)
    return _positive(cfg, "rope_local_base_freq", 10000.0)


def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"bad config value: {key} = {value!r} (must be a positive number)")
    return float(value)


def _positive_or_none(cfg: dict[str, Any], key: str) -> float | None:
    return None if cfg.get(key) is None else _positive(cfg, key, 0.0)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + w): `weight` holds the checkpoint's w, and prepare() folds the 1 in once, in
    fp32, as transformers computes (1 + w.float()). An fp32 model then runs Llama's fused norm on the folded
    weight (the same products as transformers); a bf16 one normalizes and scales in fp32 and rounds once, where
    the fused kernel would round the folded weight and the product to bf16."""

    scale: torch.Tensor  # fp32 1 + w, set by fold()

    def fold(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`: residual += x (in place) and return the norm of the sum."""
        if x.dtype == self.scale.dtype:
            return self.op(x, self.scale, self.eps, residual)
        if residual is not None:
            residual.add_(x)
            x = residual
        return torch.rms_norm(x.float(), (x.shape[-1],), self.scale, self.eps).to(x.dtype)

    __call__ = forward  # no hooks: skip nn.Module.__call__


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's score scale and soft-cap, and (1 + w) norms over each q and k head
    (Gemma 3, ModelArgs.qk_norm)."""

    def __init__(self, a: ModelArgs, g: GemmaArgs, rope: RotaryEmbedding, window: int) -> None:
        super().__init__(a, rope, window)
        self.attn = PagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, sliding_window=window,
                                   softcap=g.attn_logit_softcapping, scale=g.query_pre_attn_scalar ** -0.5)
        if a.qk_norm:
            self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)


class GemmaMLP(LlamaMLP):
    def __init__(self, a: ModelArgs, g: GemmaArgs) -> None:
        super().__init__(a)
        self.approximate = g.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)

    __call__ = forward  # no hooks: skip nn.Module.__call__


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, g: GemmaArgs, rope: RotaryEmbedding, window: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(a, g, rope, window)
        self.mlp = GemmaMLP(a, g)
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (post-feed-forward-normed); residual: the running sum (None at the
        first layer). The residual adds are fused into the pre-norms: residual += x, then normalize."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, meta))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    __call__ = forward  # no hooks: skip nn.Module.__call__


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text; Llama's weight loading (same HF names, q|k|v and gate|up fused), attention
    layers and kernel choice (prepare), with Gemma's layers, embedding scale and logit soft-cap."""

    embed_scale: torch.Tensor  # sqrt(hidden) in the compute dtype, set by prepare()

    def __init__(self, a: ModelArgs, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)  # not Llama's layers: Gemma's own are built here
        self.args = a
        self.gemma = g = GemmaArgs.from_args(a)
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling, a.rotary_dim,
                               max_model_len)
        local = rope if g.rope_local_theta is None else RotaryEmbedding(
            a.head_dim, a.max_position_embeddings, g.rope_local_theta, None, a.rotary_dim, max_model_len)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(a, g, local if w else rope, w) for w in a.layer_windows)
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.stack: DecoderStack | None = None  # never built for Gemma (_decoder_stack)

    @staticmethod
    def weight_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
        """Llama's weights (q/k head norms where a.qk_norm) and the two feed-forward norms of each layer."""
        shapes = llama_weight_shapes(a)
        for i in range(a.num_layers):
            shapes[f"layers.{i}.pre_feedforward_layernorm.weight"] = (a.hidden_size,)
            shapes[f"layers.{i}.post_feedforward_layernorm.weight"] = (a.hidden_size,)
        return shapes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. `num_layers` exits early (self-speculative drafts)."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers if num_layers is None else islice(self.layers, num_layers):
            x, residual = layer(x, residual, positions, meta)
        return self.norm(x, residual)

    def prepare(self, policy: KernelPolicy) -> None:
        """Llama's kernel choice per layer, then each norm's (1 + w) folded once from its loaded weight."""
        super().prepare(policy)
        # sqrt(hidden) rounded to the compute dtype first, as transformers' scaled embedding does.
        self.embed_scale = torch.tensor(self.args.hidden_size ** 0.5, dtype=self.norm.weight.dtype)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.fold()

    def _decoder_stack(self) -> DecoderStack | None:
        return None  # the C++ stack runs Llama's layer (two x * w norms, SiLU); Gemma's differs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.gemma.final_logit_softcapping
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
