"""Weight transforms of the on-the-fly methods: float weight [N, K] -> PackedWeight.

int8: symmetric per output channel, s = max|w| / 127, q = round(w / s) in [-127, 127].
int4: group-wise asymmetric round-to-nearest (pagoda.quantization.int4_format), group 128 by default,
      falling back to 64/32 where K is not a multiple (effective_group_size).
fp8:  float8 e4m3fn with a per-channel scale s = max|w| / 448 (e4m3's largest finite value).
"""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.layers.linear import Linear
from pagoda.quantization.int4_format import GROUP_SIZES, Int4Weight, effective_group_size, quantize_int4_rtn

METHODS = ("int8", "int4", "fp8", "gguf")
ON_THE_FLY = ("int8", "int4", "fp8")
FP8_MAX = 448.0


def check_method(method: str | None) -> str | None:
    if method is None or method in ("none", ""):
        return None
    if method not in METHODS:
        raise ValueError(f"quantization: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method


def lm_head_method(method: str) -> str:
    """The LM head's method under `method`: the tied head (SmolLM2: 49152 x 576, a fifth of the weights) is
    read every decode step, so it is quantized too, but INT4 methods keep it at INT8: an int4 head alone
    costs SmolLM2 several percent of perplexity, an int8 head almost none (`pagoda bench quant`)."""
    return "int8" if method == "int4" else method


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.clamp(torch.round(w / scales), -127, 127).to(torch.int8)
    return PackedWeight("int8", q.contiguous(), scales.contiguous(), None, w.shape[1], w.shape[1])


def quantize_fp8(w: torch.Tensor) -> PackedWeight:
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return PackedWeight("fp8", q.contiguous(), scales.contiguous(), None, w.shape[1], w.shape[1])


def int4_to_packed(q: Int4Weight) -> PackedWeight:
    """The shared INT4 format as the kernel's PackedWeight: offset = -scale * zero."""
    scales = q.scales.float().contiguous()
    return PackedWeight("int4", q.qweight.contiguous(), scales, (-scales * q.zeros.float()).contiguous(),
                        q.group_size, q.shape[1])


def int4_group_size(k: int, requested: int = 128) -> int:
    """effective_group_size, or one group per row for an even K no standard size divides."""
    if requested not in GROUP_SIZES:
        raise ValueError(f"int4 group size {requested} not supported; choose one of {GROUP_SIZES}")
    try:
        return effective_group_size(k, requested)
    except ValueError:
        if k % 2:
            raise ValueError(f"int4 needs an even input size, got {k}") from None
        return k


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> PackedWeight:
    return int4_to_packed(quantize_int4_rtn(w, int4_group_size(w.shape[1], group_size)))


def quantize_weight(method: str, w: torch.Tensor, group_size: int = 128) -> PackedWeight:
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size)
    if method == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"quantization: {method!r} is not an on-the-fly weight method ({', '.join(ON_THE_FLY)})")


def quantize_linears(module: nn.Module, method: str, vocab_head: Linear) -> None:
    """Quantize each float Linear of `module` in place with `method` (`vocab_head`, the one over the vocabulary,
    with lm_head_method's), before the kernels are chosen (Linear.prepare)."""
    for m in module.modules():
        if isinstance(m, Linear) and m.qweight is None:
            m.set_quantized(quantize_weight(lm_head_method(method) if m is vocab_head else method, m.weight.detach()))
