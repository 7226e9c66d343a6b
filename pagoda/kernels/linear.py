"""Dense linear op: F.linear, or a weight-streaming kernel for the few-row (decode) case."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagoda.config import cpu_has_native_bf16
from pagoda.kernels.cpu_extension import kernel_available

SMALL_M = 8  # rows up to which the streaming kernel beats oneDNN/MKL (decode batches)


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def small_m_supported(dtype: torch.dtype, in_features: int) -> bool:
    """The C++ kernel is built with -march=native: AVX-512 for fp32, AVX512-BF16 for bf16."""
    if dtype == torch.bfloat16:
        ok = cpu_has_native_bf16() and "avx512_bf16" in _cpu_flags() and in_features % 32 == 0
    elif dtype == torch.float32:
        ok = "avx512f" in _cpu_flags() and in_features % 16 == 0
    else:
        return False
    return ok and kernel_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m_ok: bool) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). `small_m_ok`: small_m_supported() for this layer."""
    if small_m_ok and x.shape[0] <= SMALL_M and x.dim() == 2 and x.device.type == "cpu":
        return torch.ops.pagoda.small_m_linear(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)
