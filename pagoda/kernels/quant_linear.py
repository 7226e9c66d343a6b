"""Quantized linear op: one interface over packed INT4 / INT8 / FP8 weights, dispatched per M.

Every format is stored as `PackedWeight`: codes plus a per-(row, group) fp32 scale and optional
fp32 offset, w = code * scale + offset (INT4's zero point z becomes offset = -scale * z; GGUF Q4_1's
min m is the offset directly). The CPU path is the C++ streaming kernel (cpu/quant_linear.cpp),
which reads each packed weight once per 8 activation rows and accumulates in fp32, for up to
CPP_MAX_M rows (decode); more rows dequantize the weight in C++ and run oneDNN's GEMM (prefill). On
request (PAGODA_INT4_ACTIVATIONS=int8), INT4 layers are prepared as int4x8 (`kernel_layout`): an 8-row
interleaved layout whose few-row kernel quantizes activations to INT8 per 32 columns and computes with
integer dot products (VNNI). Shapes the kernels cannot take (K or group not a multiple of 32), a missing
build, or another device use the torch fallback (PackedWeight.dequantize, then F.linear). A CUDA path
would plug in as another branch of `quant_linear`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_extension import kernel_available

FORMATS = {"int4": 0, "int8": 1, "fp8": 2, "int4x8": 3}

# "float" (default: INT4 stays weight-only) or "int8" (int4x8, see kernel_layout; its perplexity cost is in
# docs/benchmarks.md). Read when a model is prepared.
INT4_ACTIVATIONS_ENV = "PAGODA_INT4_ACTIVATIONS"


@dataclass
class PackedWeight:
    fmt: str                     # "int4" | "int8" | "fp8" | "int4x8" (int4 in 8-row blocks, see interleave8)
    data: torch.Tensor           # int4: uint8 [N, K // 2] (low nibble = even k); int8: int8 [N, K]; fp8: uint8 [N, K]
    scales: torch.Tensor         # fp32 [N, K // group_size] (int4x8: [N // 8, K // group_size, 8])
    offsets: torch.Tensor | None  # like scales, or None (symmetric)
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0] * (8 if self.fmt == "int4x8" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.offsets) if t is not None)

    def interleave8(self) -> "PackedWeight":
        """INT4 as int4x8, the layout of the INT8-activation kernel: per block of 8 rows and 64 columns,
        8 vectors whose 32-bit lane j holds 4 bytes of row j, so one VNNI instruction advances all 8 rows
        (cpu/quant_linear.cpp, blocks_int4x8_i8); scales and offsets as [N / 8, G, 8]."""
        if self.fmt != "int4" or self.out_features % 8 or self.in_features % 64:
            raise ValueError(f"int4x8 needs int4 with rows % 8 == 0 and K % 64 == 0, not {self.fmt} "
                             f"[{self.out_features}, {self.in_features}]")
        n, k = self.out_features, self.in_features
        data = self.data.view(n // 8, 8, k // 64, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 8, 4 * k)
        return PackedWeight("int4x8", data.contiguous(), _blocks_of_8(self.scales),
                            None if self.offsets is None else _blocks_of_8(self.offsets), self.group_size, k)

    def row_major(self) -> "PackedWeight":
        """The inverse of interleave8 (any other format is returned as it is)."""
        if self.fmt != "int4x8":
            return self
        n, k = self.out_features, self.in_features
        data = self.data.view(n // 8, k // 64, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(n, k // 2)
        offsets = None if self.offsets is None else _rows_of(self.offsets)
        return PackedWeight("int4", data.contiguous(), _rows_of(self.scales), offsets, self.group_size, k)

    def codes(self) -> torch.Tensor:
        """Per-weight codes as fp32 [N, K] (FP8: the e4m3 values themselves)."""
        if self.fmt == "int4x8":
            return self.row_major().codes()
        if self.fmt == "int4":
            d = self.data
            return torch.stack((d & 0xF, d >> 4), dim=-1).reshape(d.shape[0], -1).float()
        if self.fmt == "fp8":
            return self.data.view(torch.float8_e4m3fn).float()
        return self.data.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective float weight [N, K] every path computes with (the reference)."""
        if self.fmt == "int4x8":
            return self.row_major().dequantize(dtype)
        n, k, g = self.out_features, self.in_features, self.group_size
        w = self.codes().view(n, k // g, g) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets.unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "PackedWeight":
        """A PackedWeight of the selected output rows (row permutations, e.g. GGUF's Q/K un-permute)."""
        if self.fmt == "int4x8":
            return self.row_major().rows(index)
        return PackedWeight(self.fmt, self.data[index].contiguous(), self.scales[index].contiguous(),
                            None if self.offsets is None else self.offsets[index].contiguous(),
                            self.group_size, self.in_features)

    @staticmethod
    def cat(parts: list["PackedWeight"]) -> "PackedWeight":
        """Stack along output rows (fused q|k|v and gate|up); all parts share format and groups."""
        parts = [p.row_major() for p in parts]
        p0 = parts[0]
        if any((p.fmt, p.group_size, p.in_features) != (p0.fmt, p0.group_size, p0.in_features) for p in parts):
            raise ValueError("cannot fuse quantized weights with different formats or group sizes")
        has_off = [p.offsets is not None for p in parts]
        offsets = None
        if any(has_off):
            offsets = torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts])
        return PackedWeight(p0.fmt, torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]),
                            offsets, p0.group_size, p0.in_features)


def _blocks_of_8(t: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N / 8, G, 8]: one group's scales of 8 consecutive rows are one vector."""
    return t.view(t.shape[0] // 8, 8, -1).transpose(1, 2).contiguous()


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """The inverse of _blocks_of_8: [N / 8, G, 8] -> [N, G]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()


def kernel_layout(pw: PackedWeight) -> PackedWeight:
    """The layout the chosen CPU kernel takes: with PAGODA_INT4_ACTIVATIONS=int8, INT4 becomes int4x8
    where the build has that kernel (VNNI + GFNI; K a multiple of 64; rows a multiple of 8)."""
    mode = os.environ.get(INT4_ACTIVATIONS_ENV, "float")
    if mode not in ("int8", "float"):
        raise ValueError(f"{INT4_ACTIVATIONS_ENV} must be 'float' or 'int8', not {mode!r}")
    if pw.fmt != "int4" or not cpp_supported(pw) or pw.out_features % 8:
        return pw
    if mode == "float" or not torch.ops.pagoda.int4x8_supported(pw.in_features, pw.group_size):
        return pw
    return pw.interleave8()


def cpp_supported(pw: PackedWeight) -> bool:
    k, g = pw.in_features, pw.group_size
    return k % 32 == 0 and g % 32 == 0 and k % g == 0 and pw.data.device.type == "cpu" and kernel_available() \
        and hasattr(torch.ops.pagoda, "quant_linear")


# Above this many rows the weight is dequantized (C++, to the activation dtype) and multiplied by
# oneDNN's GEMM: the streaming kernel is compute-bound there. Set from `python -m
# pagoda.bench.quant_kernels` on this machine (see docs/architecture.md).
CPP_MAX_M = 16


def quant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, use_cpp: bool | None = None,
                 max_cpp_m: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(pw)^T (+ bias), in x's dtype. `use_cpp`: cpp_supported(pw), precomputed per layer."""
    if use_cpp is None:
        use_cpp = cpp_supported(pw)
    if x.dim() != 2:
        return quant_linear(x.reshape(-1, x.shape[-1]), pw, bias, use_cpp, max_cpp_m).reshape(*x.shape[:-1], -1)
    m = x.shape[0]
    if use_cpp and 0 < m <= (CPP_MAX_M if max_cpp_m is None else max_cpp_m) and x.device.type == "cpu":
        # Returns x's dtype (fp32 accumulation, one rounding on output). Bias is fp32 (Linear.set_quantized).
        return torch.ops.pagoda.quant_linear(x if x.is_contiguous() else x.contiguous(), pw.data, pw.scales,
                                             pw.offsets, None if bias is None else bias.float().contiguous(),
                                             FORMATS[pw.fmt], pw.group_size)
    return dequant_linear(x, pw, bias, use_cpp)


def dequant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, use_cpp: bool = False) -> torch.Tensor:
    """Dequantize to x's dtype (the C++ kernel where `use_cpp`, else PackedWeight.dequantize, the
    reference) and run F.linear: the many-row path, and the fallback everywhere else."""
    if use_cpp and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        w = torch.ops.pagoda.quant_dequantize(pw.data, pw.scales, pw.offsets, FORMATS[pw.fmt], pw.group_size,
                                              pw.in_features, x.dtype)
    else:
        w = pw.dequantize(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
