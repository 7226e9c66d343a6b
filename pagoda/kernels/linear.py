"""Dense linear op, on a copy of the weight laid out once at load.

fp32 and bf16 on AVX-512: Pagoda's panel-packed GEMM (cpu/packed_linear.cpp) at every row count: with cold
weights it reads them faster than the row-major streaming kernel and oneDNN's prepacked GEMM at decode and small
batch sizes, and keeps up with oneDNN at prefill sizes. Elsewhere (shapes it can't take, other CPUs, the torch
fallback): oneDNN on a prepacked weight (F.linear re-lays the weight out on every call).
`python -m benchmarks.quant_kernels` times them per shape; the figures are in docs/architecture.md and
docs/benchmarks.md. The packed copy costs the weight's size in memory again.

Batch invariance: a row's result must not depend on how many rows share the call. The panel kernel sums each
output in one order at every row count. oneDNN does from two rows up, but computes one row alone with another
kernel, so `onednn_linear` pads a lone row to two (tests/test_batch_invariance.py holds every kernel to the
rule); MKL's fp32 GEMM (F.linear) changes its order up to 16 rows, and is not used where oneDNN is there. The
few-row streaming kernel (small_m_linear) sums in another order than oneDNN, so a layer does not switch between
them by row count.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_extension import build_isa

SMALL_M = 8  # rows up to which the streaming kernel beats oneDNN/MKL (decode batches)
MIN_ONEDNN_ROWS = 2  # see "Batch invariance" above
PANEL = 16  # output columns per panel of packed_linear's layout
# stack_rows of a kernel that is the same at every row count (panels, the quantized kernels): the C++ decoder
# stack runs every step with it: one op call a step instead of about eight a layer.
ANY_M = 1 << 30


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


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN multiplies `dtype` on this CPU: fp32 wherever torch has it, bf16 only where the CPU
    has bf16 instructions (AVX512-BF16, AMX or AVX-NE-CONVERT; elsewhere oneDNN has no bf16 kernel to create)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a CPU fp32/bf16 weight [N, K], or None where oneDNN can't take it."""
    if weight.device.type != "cpu" or not onednn_runs(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: the batch size it tunes for
    except (RuntimeError, AttributeError):
        return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) through oneDNN, `weight` prepacked (prepack) or plain [N, K]; with fewer than
    MIN_ONEDNN_ROWS rows x is padded with zeros, so each row's sums are the same at every M."""
    m = x.shape[0]
    if m >= MIN_ONEDNN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    padded = torch.cat([x, x.new_zeros(MIN_ONEDNN_ROWS - m, x.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:m]


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, through oneDNN (onednn_linear) for CPU fp32/bf16 where torch has it: the torch fallback's matmul
    (a dequantized weight, a dense one without a prepacked copy)."""
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype and onednn_runs(x.dtype):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m_ok: bool,
           packed: torch.Tensor | None = None, panels: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). `panels`: panel_pack(weight), used at every M when set;
    else `small_m_ok`: small_m_supported() for this layer, used up to SMALL_M rows (benchmarks only: a layer that
    switches kernels by row count is not batch invariant), and `packed`: prepack(weight) (same math as
    F.linear); else dense_linear."""
    if x.dim() == 2 and x.device.type == "cpu":
        if panels is not None and x.dtype == panels.dtype:
            return torch.ops.pagoda.packed_linear(x.contiguous(), panels, bias)
        if small_m_ok and x.shape[0] <= SMALL_M:
            return torch.ops.pagoda.small_m_linear(x.contiguous(), weight, bias)
        if packed is not None and x.dtype == weight.dtype:
            return onednn_linear(x, packed, bias)
    return dense_linear(x, weight, bias)
