"""Dense linear op: a weight-streaming kernel for the few-row (decode) case, and oneDNN's GEMM on a
weight packed once at load for everything else.

On SmolLM2's shapes oneDNN on a prepacked weight beats F.linear (which re-lays the weight out on every
call) from M = 9 up, in fp32 by the most: `python -m pagoda.bench.quant_kernels`. The packed copy
costs the weight's size in memory again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.config import cpu_has_native_bf16
from pagoda.kernels.cpu_extension import cpu_flags, has_avx512, kernel_available

SMALL_M = 8  # rows up to which the streaming kernel beats oneDNN/MKL (decode batches)


def small_m_supported(dtype: torch.dtype, in_features: int) -> bool:
    """The C++ kernel is built with -march=native: AVX-512 for fp32, AVX512-BF16 for bf16."""
    if dtype == torch.bfloat16:
        ok = cpu_has_native_bf16() and "avx512_bf16" in cpu_flags() and in_features % 32 == 0
    elif dtype == torch.float32:
        ok = has_avx512() and in_features % 16 == 0
    else:
        return False
    return ok and kernel_available()


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a CPU fp32/bf16 weight [N, K], or None where oneDNN can't take it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: the batch size it tunes for
    except (RuntimeError, AttributeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m_ok: bool,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). `small_m_ok`: small_m_supported() for this layer;
    `packed`: prepack(weight), used above SMALL_M rows (same math as F.linear)."""
    if x.dim() == 2 and x.device.type == "cpu":
        if small_m_ok and x.shape[0] <= SMALL_M:
            return torch.ops.pagoda.small_m_linear(x.contiguous(), weight, bias)
        if packed is not None and x.dtype == weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
