"""Dense linear op, on a copy of the weight laid out once at load.

bf16 (AVX512-BF16): Pagoda's pair-packed GEMM (cpu/packed_linear.cpp) at every row count. Over all of
SmolLM2's linears with cold weights it is 1.0x the streaming kernel below at 1-2 rows, 1.2-1.6x at 4-8,
1.2-1.7x oneDNN's prepacked GEMM at 8-64 rows (batched decode), level from 256 (prefill).
fp32: a weight-streaming kernel for the few-row (decode) case, and oneDNN's GEMM on a prepacked weight
(beats F.linear, which re-lays the weight out on every call, from M = 9 up) for everything else.
`python -m pagoda.bench.quant_kernels` times them per shape. The packed copy costs the weight's size
in memory again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.config import cpu_has_native_bf16
from pagoda.kernels.cpu_extension import cpu_flags, has_avx512, kernel_available

SMALL_M = 8  # rows up to which the streaming kernel beats oneDNN/MKL (decode batches)
# Over pair-packed weights the C++ decoder stack runs every step: its linear kernel is the same at every
# row count, and one op call a step instead of ~8 a layer was +4% on bench throughput's 64-request run.
PAIRS_STACK_MAX_M = 1 << 30


def small_m_supported(dtype: torch.dtype, in_features: int) -> bool:
    """The C++ kernel is built with -march=native: AVX-512 for fp32, AVX512-BF16 for bf16."""
    if dtype == torch.bfloat16:
        ok = cpu_has_native_bf16() and "avx512_bf16" in cpu_flags() and in_features % 32 == 0
    elif dtype == torch.float32:
        ok = has_avx512() and in_features % 16 == 0
    else:
        return False
    return ok and kernel_available()


def pair_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The pair-packed layout of a CPU bf16 weight [N, K] for packed_linear, or None where it can't take it."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 \
            or weight.shape[0] % 16 or weight.shape[1] % 2 or not small_m_supported(torch.bfloat16, 32):
        return None
    return torch.ops.pagoda.pack_bf16_pairs(weight.detach())


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
           packed: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). `pairs`: pair_pack(weight), used at every M when set;
    else `small_m_ok`: small_m_supported() for this layer, and `packed`: prepack(weight), used above
    SMALL_M rows (same math as F.linear)."""
    if x.dim() == 2 and x.device.type == "cpu":
        if pairs is not None and x.dtype == torch.bfloat16:
            return torch.ops.pagoda.packed_linear(x.contiguous(), pairs, bias)
        if small_m_ok and x.shape[0] <= SMALL_M:
            return torch.ops.pagoda.small_m_linear(x.contiguous(), weight, bias)
        if packed is not None and x.dtype == weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
