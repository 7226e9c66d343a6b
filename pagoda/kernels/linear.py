"""Dense linear op, on a copy of the weight laid out once at load.

fp32 and bf16 on AVX-512: Pagoda's panel-packed GEMM (cpu/packed_linear.cpp) at every row count: over
SmolLM2's linears with cold weights it beats the row-major streaming kernel and oneDNN's prepacked GEMM
from 1 to 64 rows and stays within a few percent of oneDNN at prefill sizes. Elsewhere (shapes it can't
take, other CPUs): the streaming kernel for few rows (SMALL_M) and oneDNN on a prepacked weight (beats
F.linear, which re-lays the weight out on every call, from M = 9 up). `python -m benchmarks.quant_kernels`
times them per shape; the figures are in docs/architecture.md and docs/benchmarks.md. The packed copy costs
the weight's size in memory again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_extension import build_isa

SMALL_M = 8  # rows up to which the streaming kernel beats oneDNN/MKL (decode batches)
PANEL = 16  # output columns per panel of packed_linear's layout
# Over panel-packed weights the C++ decoder stack runs every step: its linear kernel is the same at every
# row count, and one op call a step instead of ~8 a layer was +4% on bench throughput's 64-request run.
PANELS_STACK_MAX_M = 1 << 30


def vector_kernels(dtype: torch.dtype) -> bool:
    """Whether the loaded build of the C++ linear kernels runs `dtype`: they need AVX-512 for fp32 and
    AVX512-BF16 for bf16 (the avx2 build has neither: oneDNN runs its linears)."""
    if dtype == torch.bfloat16:
        return build_isa().avx512_bf16
    return dtype == torch.float32 and build_isa().avx512


def small_m_supported(dtype: torch.dtype, in_features: int) -> bool:
    """The streaming kernel also needs K to fill whole vectors (32 bf16 or 16 fp32 values)."""
    return vector_kernels(dtype) and in_features % (32 if dtype == torch.bfloat16 else 16) == 0


def panel_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A CPU weight [N, K] in packed_linear's panels of 16 output columns: fp32 [N/16, K, 16], bf16
    [N/16, K/2, 16, 2] (pairs along K); None where the kernel can't take it."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if weight.device.type != "cpu" or n == 0 or n % PANEL or k % 2 or not vector_kernels(weight.dtype):
        return None
    w = weight.detach()
    if weight.dtype == torch.bfloat16:
        return w.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


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
           packed: torch.Tensor | None = None, panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). `panels`: panel_pack(weight), used at every M when set;
    else `small_m_ok`: small_m_supported() for this layer, and `packed`: prepack(weight), used above
    SMALL_M rows (same math as F.linear)."""
    if x.dim() == 2 and x.device.type == "cpu":
        if panels is not None and x.dtype == panels.dtype:
            return torch.ops.pagoda.packed_linear(x.contiguous(), panels, bias)
        if small_m_ok and x.shape[0] <= SMALL_M:
            return torch.ops.pagoda.small_m_linear(x.contiguous(), weight, bias)
        if packed is not None and x.dtype == weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
