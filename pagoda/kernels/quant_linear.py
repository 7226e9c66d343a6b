"""Quantized linear op: one interface over packed INT4 / INT8 / FP8 weights.

Every format is stored as `PackedWeight`: codes plus a per-(row, group) fp32 scale and optional
fp32 offset, w = code * scale + offset (INT4's zero point z becomes offset = -scale * z; GGUF Q4_1's
min m is the offset directly). With bf16 or fp32 activations, where the build has the panel kernel
(AVX512-BF16), INT4, INT8 and FP8 weights are prepared in panels of 16 output columns (`kernel_layout`: layout
"panels16") for one C++ kernel at every row count (cpu/quant_panel_linear.cpp). Elsewhere (other builds: avx2,
Arm; shapes the panels cannot take) the portable row-major kernel (cpu/quant_linear.cpp) runs, also at every row
count, with fp32 sums. On request (config `quant_activations="int8"`), INT4 layers quantize their activations to INT8
per 32 columns and compute with integer dot products: layout "interleave8" (8 interleaved rows: VNNI's vpdpbusd,
AVX2's vpmaddubsw or Arm's sdot) where the shape allows, else "rows_a8" (the row-major codes, AVX2); both compute
the same sums. Shapes the kernels cannot take (K or group not a multiple of 32), a missing build, or another device
use the torch fallback (`dequant_linear`). A CUDA path would plug in as another branch of `quant_linear`.
GGUF's block formats (format "gguf": Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS, MXFP4, and Q4_0, Q4_1,
Q8_0 fused beside them, kernels/gguf_blocks.py) keep their blocks' bits and run the portable panel driver with their
own block decoders, at every row count and on every build.

Batch invariance: a row's result does not depend on the other rows of the call. Each C++ kernel sums every
output in one order at every row count, and the fallback multiplies through oneDNN with at least two rows
(kernels/linear.py: onednn_linear); so no path switches kernels by row count.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from pagoda.kernels import gguf_blocks
from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.linear import PANEL, dense_linear
from pagoda.kernels.linear_formats import (
    FIRST_PANEL_CODE,
    FIRST_VPANEL_CODE,
    GGUF_DRIVER_CODES,
    QUANT_CODES,
    GgufDriver,
    Layout,
    QuantFormat,
)

# Output rows per row of `data`, by layout.
_ROWS_PER_DATA_ROW: dict[Layout, int] = {"rows": 1, "interleave8": 8, "rows_a8": 1, "panels16": PANEL}


def vpanel_width() -> int:
    """Output columns per portable panel (2W: the loaded build's vector lanes, cpu/simd.h)."""
    return torch.ops.pagoda.vpanel_width()


@dataclass
class PackedWeight:
    """One quantized weight [N, K]: `format` says what a code is, `layout` how a kernel reads the codes
    (linear_formats.Layout); `code`, derived from the two, is what the C++ kernels dispatch on."""
    format: QuantFormat          # "int4" | "int8" | "fp8" (e4m3) | "gguf" (GGUF super-blocks, gguf_blocks.py)
    data: torch.Tensor           # rows: int4 uint8 [N, K / 2] (low nibble = even k), int8 int8 [N, K], fp8 uint8 [N, K]
    scales: torch.Tensor         # fp32 [N, K // group_size] (interleave8: [N // 8, G, 8]; panels16: [N // 16, G, 16];
    #                              gguf: the segment table int64 [S, 3], and data the blocks uint8 [bytes])
    offsets: torch.Tensor | None  # like scales, or None (symmetric)
    group_size: int
    in_features: int
    layout: Layout = "rows"      # interleave8 and panels16 are made by the methods of those names
    # Which driver reads gguf vpanels (kernel_layout): "float" the panel drivers (weight-only), "amx" the AMX tiles
    # (bf16 activations), "int8" the integer dot products with activations rounded as llama.cpp rounds them.
    gguf_driver: GgufDriver = "float"

    def __post_init__(self) -> None:
        if (self.format, self.layout) not in QUANT_CODES:  # e.g. interleave8 is INT4's only
            raise ValueError(f"no kernel takes {self.format!r} weights in layout {self.layout!r}")
        if self.gguf_driver != "float" and (self.format, self.layout) != ("gguf", "vpanels"):
            raise ValueError(f"only GGUF blocks in vpanels take the {self.gguf_driver!r} driver")

    @property
    def amx(self) -> bool:
        return self.gguf_driver == "amx"

    @property
    def code(self) -> int:
        """The kernels' code for this format in this layout (cpu/linear_formats.h)."""
        return GGUF_DRIVER_CODES.get(self.gguf_driver) or QUANT_CODES[self.format, self.layout]

    @property
    def out_features(self) -> int:
        if self.format == "gguf":
            return int(self.scales[:, 1].sum())
        if self.layout == "vpanels":  # [N / P, K, P] (INT4: P / 2 bytes of two codes)
            return self.data.shape[0] * self.data.shape[2] * (2 if self.format == "int4" else 1)
        return self.data.shape[0] * _ROWS_PER_DATA_ROW[self.layout]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.offsets) if t is not None)

    def _require_row_major(self, target: Layout, fmt: QuantFormat, needs: str, ok: bool) -> None:
        """Raise unless this is a row-major `fmt` weight of the shape `target` needs (`ok`)."""
        if (self.format, self.layout) != (fmt, "rows") or not ok:
            raise ValueError(f"{target} needs row-major {fmt} with {needs}, not {self.format} ({self.layout}) "
                             f"[{self.out_features}, {self.in_features}] g{self.group_size}")

    def interleave8(self) -> PackedWeight:
        """INT4 in layout interleave8, the INT8-activation kernel's: per block of 8 rows and 64 columns,
        8 vectors whose 32-bit lane j holds 4 bytes of row j, so one VNNI instruction (two on AVX2 and Arm) advances
        all 8 rows (cpu/int4x8_i8.h); scales and offsets as [N / 8, G, 8]."""
        self._require_row_major("interleave8", "int4", "rows % 8 == 0 and K % 64 == 0",
                                self.out_features % 8 == 0 and self.in_features % 64 == 0)
        n, k = self.out_features, self.in_features
        data = self.data.view(n // 8, 8, k // 64, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 8, 4 * k)
        return PackedWeight("int4", data.contiguous(), _blocks_of_8(self.scales),
                            None if self.offsets is None else _blocks_of_8(self.offsets), self.group_size, k,
                            "interleave8")

    def rows_a8(self) -> PackedWeight:
        """INT4 for the AVX2 INT8-activation kernel (cpu/quant_linear.cpp, rows_int4_a8): the row-major codes as
        they are, which that kernel reads as vpmaddubsw operands against x quantized per 32 columns."""
        self._require_row_major("rows_a8", "int4", "K and groups of a multiple of 32",
                                self.in_features % 32 == 0 and self.group_size % 32 == 0)
        return PackedWeight("int4", self.data, self.scales, self.offsets, self.group_size, self.in_features, "rows_a8")

    def vpanels(self, width: int) -> PackedWeight:
        """Layout vpanels, the portable panel kernel's (cpu/quant_vpanel_linear.cpp), in panels of `width` output
        columns (vpanel_width(): the build's 2W): codes [N / P, K, P] in k order (INT4: [N / P, K, P / 2], byte j
        holding column j in its low nibble and column j + P / 2 in its high one); scales and offsets [N / P, G, P], in
        fp16 where every one of them is an fp16 number (a GGUF's Q4_0/Q4_1/Q8_0 blocks: the kernel widens them back
        exactly, so the sums are the fp32 layout's, and batch-1 decode, bound by the weights' bytes, reads 1 bit a
        weight fewer), else fp32. GGUF blocks regroup into the panels of gguf_blocks.py, with the same bits."""
        if self.format == "gguf" and self.layout == "rows":
            data, table = gguf_blocks.to_panels(self.data, self.scales, self.in_features, width)
            return PackedWeight("gguf", data, table, None, self.group_size, self.in_features, "vpanels")
        self._require_row_major("vpanels", self.format, f"rows % {width} == 0 (FP8: per-channel scales)",
                                self.out_features % width == 0 and (self.format != "fp8" or self.offsets is None))
        n, k, half = self.out_features, self.in_features, width // 2
        if self.format == "int4":
            q = self.codes().to(torch.uint8).view(n // width, width, k).transpose(1, 2)  # [P', K, width]
            data = q[..., :half] | (q[..., half:] << 4)
        else:
            data = self.data.view(n // width, width, k).transpose(1, 2)
        scales, offsets = _half_if_exact(self.scales, self.offsets)
        return PackedWeight(self.format, data.contiguous(), _panels_of(scales, width),
                            None if offsets is None else _panels_of(offsets, width), self.group_size, k, "vpanels")

    def panels16(self) -> PackedWeight:
        """Layout panels16, the bf16 panel kernel's (cpu/quant_panel_linear.cpp), whatever the format."""
        return {"int4": self.int4_panels, "int8": self.int8_panels, "fp8": self.fp8_panels}[self.format]()

    def int4_panels(self) -> PackedWeight:
        """INT4 in panels16: codes uint8 [N / 16, K / 8, 64], one 64-byte block per 8 k x 16 columns,
        nibbles placed so that unpacking each half against a 0x43 byte yields vdpbf16ps operands; scales
        and offsets as [N / 16, G, 16]."""
        self._require_row_major("panels16", "int4", f"rows % {PANEL} == 0 and groups of a multiple of 8",
                                self.out_features % PANEL == 0 and self.group_size % 8 == 0)
        n, k = self.out_features, self.in_features
        c, k_lo, k_hi = _panel_byte_map()
        q = self.codes().to(torch.uint8).view(n // PANEL, PANEL, k // 8, 8).transpose(1, 2)  # [P, K/8, 16, 8]
        data = q[:, :, c, k_lo] | (q[:, :, c, k_hi] << 4)
        return PackedWeight("int4", data.contiguous(), _panels_of(self.scales),
                            None if self.offsets is None else _panels_of(self.offsets), self.group_size, k,
                            "panels16")

    def int8_panels(self) -> PackedWeight:
        """INT8 in panels16: codes uint8 [N / 16, K / 8, 128] laid out as fp8_panels lays out e4m3 bytes (the kernel
        turns each code into the bf16 integer it is); scales and offsets as [N / 16, G, 16]."""
        self._require_row_major("panels16", "int8", f"rows % {PANEL} == 0 and groups of a multiple of 8",
                                self.out_features % PANEL == 0 and self.group_size % 8 == 0)
        return PackedWeight("int8", _byte_panels(self.data.view(torch.uint8)), _panels_of(self.scales),
                            None if self.offsets is None else _panels_of(self.offsets), self.group_size,
                            self.in_features, "panels16")

    def fp8_panels(self) -> PackedWeight:
        """FP8 in panels16: e4m3 bytes [N / 16, K / 8, 128], per panel and 8 k four 32-byte vdpbf16ps operands,
        byte 2c + j of operand o being column c at k = 2o + j (the kernel turns each into a bf16 bit pattern);
        per-column scales as [N / 16, 1, 16]."""
        self._require_row_major("panels16", "fp8", f"per-channel scales, rows % {PANEL} == 0 and K % 8 == 0",
                                self.out_features % PANEL == 0 and self.in_features % 8 == 0 and self.offsets is None)
        return PackedWeight("fp8", _byte_panels(self.data), _panels_of(self.scales), None, self.group_size,
                            self.in_features, "panels16")

    def row_major(self) -> PackedWeight:
        """Layout rows: the inverse of interleave8 and panels16 (a row-major weight is returned as it is)."""
        if self.layout == "rows":
            return self
        if self.format == "gguf":
            raise ValueError("GGUF blocks in panels are not laid back into rows (dequantize_rows reads them)")
        if self.layout == "rows_a8":
            return PackedWeight("int4", self.data, self.scales, self.offsets, self.group_size, self.in_features)
        if self.layout == "vpanels":
            return self._vpanel_rows(torch.arange(self.out_features))
        n, k = self.out_features, self.in_features
        if self.layout == "interleave8":
            data = self.data.view(n // 8, k // 64, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(n, k // 2)
            offsets = None if self.offsets is None else _rows_of(self.offsets)
            return PackedWeight("int4", data.contiguous(), _rows_of(self.scales), offsets, self.group_size, k)
        return self._panel_rows(torch.arange(n))

    def codes(self) -> torch.Tensor:
        """Per-weight codes as fp32 [N, K] (FP8: the e4m3 values themselves)."""
        if self.format == "gguf":
            raise ValueError("GGUF blocks have no codes of one scale per group; dequantize() reads them")
        if self.layout != "rows":
            return self.row_major().codes()
        if self.format == "int4":
            d = self.data
            return torch.stack((d & 0xF, d >> 4), dim=-1).reshape(d.shape[0], -1).float()
        if self.format == "fp8":
            return self.data.view(torch.float8_e4m3fn).float()
        return self.data.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective float weight [N, K] every path computes with (the reference)."""
        if self.format == "gguf":
            return self.dequantize_rows(torch.arange(self.out_features), dtype)
        if self.layout != "rows":
            return self.row_major().dequantize(dtype)
        n, k, g = self.out_features, self.in_features, self.group_size
        w = self.codes().view(n, k // g, g) * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            w = w + self.offsets.unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def dequantize_rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective float weights of output rows `index`, [R, K] (an embedding's lookups)."""
        if self.format != "gguf":
            return self.rows(index).dequantize(dtype)
        if self.layout == "vpanels":
            return torch.ops.pagoda.gguf_vpanel_rows(self.data, self.scales, index.long(), self.in_features).to(dtype)
        data, table = gguf_blocks.take_rows(self.data, self.scales, index, self.in_features)
        return gguf_blocks.dequantize_rows_layout(data, table, self.in_features).to(dtype)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """A PackedWeight of the selected output rows (row permutations, e.g. GGUF's Q/K un-permute; the rows
        a QuantEmbedding gathers), row-major."""
        if self.format == "gguf":
            if self.layout != "rows":
                raise ValueError("GGUF blocks in panels: dequantize_rows gathers their rows")
            data, table = gguf_blocks.take_rows(self.data, self.scales, index, self.in_features)
            return PackedWeight("gguf", data, table, None, self.group_size, self.in_features)
        if self.layout == "panels16":  # gathered in place
            return self._panel_rows(index)
        if self.layout == "vpanels":
            return self._vpanel_rows(index)
        if self.layout != "rows":
            return self.row_major().rows(index)
        return PackedWeight(self.format, self.data[index].contiguous(), self.scales[index].contiguous(),
                            None if self.offsets is None else self.offsets[index].contiguous(),
                            self.group_size, self.in_features)

    def _panel_rows(self, index: torch.Tensor) -> PackedWeight:
        """rows() of a panels16 weight without re-laying the whole weight (a tied LM head's table serves the
        embedding's lookups; with every row, row_major()): one gather of each selected column's 8 codes per block."""
        p, c = index // PANEL, index % PANEL
        blocks = self.data[p]                                                   # [R, K/8, 64 or 128]
        scales = self.scales[p, :, c].contiguous()
        offsets = None if self.offsets is None else self.offsets[p, :, c].contiguous()
        k = self.in_features
        if self.format == "int4":
            codes = torch.cat([blocks & 0xF, blocks >> 4], dim=-1)              # nibbles [R, K/8, 128]
            where = _panel_column_nibbles()[c]
        else:  # one byte a code: byte 2c + j of operand o is column c at k = 2o + j
            codes, where = blocks, _BYTE_PANEL_COLUMNS[c]
        q = codes.gather(2, where.unsqueeze(1).expand(-1, blocks.shape[1], -1)).reshape(len(index), k)  # k order
        if self.format == "int4":
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        elif self.format == "int8":
            q = q.view(torch.int8)
        return PackedWeight(self.format, q.contiguous(), scales, offsets, self.group_size, k)

    def _vpanel_rows(self, index: torch.Tensor) -> PackedWeight:
        """rows() of a vpanels weight, gathered in place (a tied LM head's table serves the embedding's lookups)."""
        width = self.scales.shape[2]
        p, c = index // width, index % width
        scales = self.scales[p, :, c].float()  # fp16 where exact (vpanels): fp32, as row-major weights hold them
        offsets = None if self.offsets is None else self.offsets[p, :, c].float()
        if self.format == "int4":
            half = width // 2
            byte = self.data[p, :, c % half]                                    # [R, K]
            q = (byte >> (4 * (c // half)).to(torch.uint8).unsqueeze(1)) & 0xF
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        else:
            q = self.data[p, :, c]
        return PackedWeight(self.format, q.contiguous(), scales, offsets, self.group_size, self.in_features)

    def _as_gguf(self) -> PackedWeight:
        """INT8 codes of fp16 scales per 32 as the Q8_0 blocks they are, INT4 codes of fp16 scales and offsets per 32
        as Q4_0 or Q4_1 blocks (else as they are): exactly the same weights."""
        blocks = None
        if (self.layout, self.group_size) == ("rows", 32) and self.in_features % 32 == 0:
            if self.format == "int8" and self.offsets is None:
                blocks = gguf_blocks.q8_0_from_codes(self.data, self.scales)
            elif self.format == "int4":
                blocks = gguf_blocks.q4_from_codes(self.data, self.scales, self.offsets)
        if blocks is None:
            return self
        return PackedWeight("gguf", *blocks, None, 32, self.in_features)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """Stack along output rows (fused q|k|v and gate|up), row-major; all parts share format and groups."""
        parts = [p.row_major() for p in parts]
        p0 = parts[0]
        if any(p.format == "gguf" for p in parts):
            parts = [p._as_gguf() for p in parts]  # a Q8_0 or Q4_0 part beside other GGUF blocks
            if any(p.format != "gguf" or p.in_features != p0.in_features for p in parts):
                raise ValueError("cannot fuse GGUF blocks with other formats")
            tables, offset = [], 0
            for p in parts:
                tables.append(p.scales + torch.tensor([0, 0, offset]))
                offset += p.data.numel()
            return PackedWeight("gguf", torch.cat([p.data for p in parts]), torch.cat(tables), None,
                                min(p.group_size for p in parts), p0.in_features)
        if any((p.format, p.group_size, p.in_features) != (p0.format, p0.group_size, p0.in_features) for p in parts):
            raise ValueError("cannot fuse quantized weights with different formats or group sizes")
        has_off = [p.offsets is not None for p in parts]
        offsets = None
        if any(has_off):
            offsets = torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts])
        return PackedWeight(p0.format, torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]),
                            offsets, p0.group_size, p0.in_features)


def _blocks_of_8(t: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N / 8, G, 8]: one group's scales of 8 consecutive rows are one vector."""
    return t.view(t.shape[0] // 8, 8, -1).transpose(1, 2).contiguous()


def _half_if_exact(scales: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both as fp16 where every value survives the round trip (finite, in range, no lost bits), else both as given."""
    parts = [t for t in (scales, offsets) if t is not None]
    if all(torch.equal(t.half().float(), t) for t in parts):
        return scales.half(), None if offsets is None else offsets.half()
    return scales, offsets


def _panels_of(t: torch.Tensor, width: int = PANEL) -> torch.Tensor:
    """[N, G] -> [N / width, G, width]: one group's scales of a panel's columns are one or two vectors."""
    return t.view(t.shape[0] // width, width, -1).transpose(1, 2).contiguous()


def _byte_panels(data: torch.Tensor) -> torch.Tensor:
    """One-byte codes uint8 [N, K] -> [N / 16, K / 8, 128]: per panel and 8 k, four 32-byte operands, byte 2c + j of
    operand o being column c at k = 2o + j (fp8_panels, int8_panels)."""
    n, k = data.shape
    return data.view(n // PANEL, PANEL, k // 8, 4, 2).permute(0, 2, 3, 1, 4).reshape(n // PANEL, k // 8, 128) \
        .contiguous()


# For column c of a byte panel and k of a block, where its byte is among the block's 128 (_byte_panels).
_BYTE_PANEL_COLUMNS = (32 * (torch.arange(8) // 2) + torch.arange(8) % 2) + 2 * torch.arange(PANEL).unsqueeze(1)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """The inverse of _blocks_of_8 and _panels_of: [N / b, G, b] -> [N, G]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()


@functools.cache
def _panel_column_nibbles() -> torch.Tensor:
    """[16, 8]: for column c of a panel and k of a block, where its nibble is among a block's 128 (low
    nibbles of the 64 bytes, then high)."""
    col, k_lo, k_hi = _panel_byte_map()
    pos = torch.empty(PANEL, 8, dtype=torch.long)
    t = torch.arange(64)
    pos[col, k_lo] = t
    pos[col, k_hi] = 64 + t
    return pos


@functools.cache
def _panel_byte_map() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For byte t of an INT4 panels16 block: the column and the k (within the block's 8) of its low and high
    nibble. unpacklo/hi_epi8 put byte t's nibbles at word 8 (t // 16) + t % 8 of operand (t % 16) // 8
    (low) or 2 + (t % 16) // 8 (high); operand o, word 2c + j is column c at k = 2o + j."""
    t = torch.arange(64)
    half, word = (t % 16) // 8, 8 * (t // 16) + t % 8
    col, j = word // 2, word % 2
    return col, 2 * half + j, 4 + 2 * half + j


def kernel_layout(pw: PackedWeight, act_dtype: torch.dtype, quant_activations: str = "float") -> PackedWeight:
    """The layout the chosen CPU kernel takes, for activations of `act_dtype`. With `quant_activations="int8"`
    (KernelPolicy), GGUF blocks take vpanels read by the int8-activation driver (x rounded per block as llama.cpp's
    vec_dot_type rounds it, integer dot products: cpu/gguf_a8_linear.cpp), and so do INT8 codes that are exactly
    Q8_0 blocks (fp16 scales per 32), as llama.cpp runs them; INT4 takes layout interleave8 where the build has that
    kernel (AVX2, VNNI or Arm's dot products; K a multiple of 64; rows a multiple of 8), else rows_a8 (the row-major
    AVX2 kernel). Otherwise, with bf16 or fp32 activations, every format takes panels16 where the build has the panel
    kernel (AVX512-BF16; rows a multiple of 16): bf16 dot products, or fp32 FMAs on the same operands (exact products
    and fp32 sums, as the row-major kernel computes). GGUF blocks take vpanels, on AMX tiles with bf16 activations
    where the CPU has them; there INT8 and INT4 codes that are exactly Q8_0, Q4_0 or Q4_1 blocks join them as those
    blocks."""
    if quant_activations not in ("int8", "float"):
        raise ValueError(f"quant_activations must be 'float' or 'int8', not {quant_activations!r}")
    # Each layout's own predicate decides (a group of 16 takes the panels, not the row-major kernel).
    if pw.layout != "rows" or pw.data.device.type != "cpu" or not kernel_available():
        return pw
    amx = act_dtype == torch.bfloat16 and torch.ops.pagoda.gguf_amx_available()
    if (pw.format == "int8" and quant_activations == "int8") or (pw.format != "gguf" and quant_activations == "float"
                                                                  and amx):
        pw = pw._as_gguf()  # Q8_0 (and, on the tiles, Q4_0 and Q4_1) codes of fp16 scales per 32 as their blocks
    if pw.format == "gguf":
        width = vpanel_width()
        fits = all(rows % width == 0 for _, rows, _ in gguf_blocks.segments(pw.scales))
        if not fits or act_dtype not in (torch.bfloat16, torch.float32):
            return pw
        # bf16 on AMX tiles wherever the CPU has them, at every row count, as dense bf16 weights run (amx_blocks.h:
        # several times the vdpbf16ps driver's speed from a few rows up, somewhat slower at one).
        driver = "int8" if quant_activations == "int8" else "amx" if amx else "float"
        return dataclasses.replace(pw.vpanels(width), gguf_driver=driver)
    if quant_activations == "int8" and pw.format == "int4":
        if pw.out_features % 8 == 0 and torch.ops.pagoda.int4x8_supported(pw.in_features, pw.group_size):
            return pw.interleave8()
        return pw.rows_a8() if torch.ops.pagoda.int4a8_supported(pw.in_features, pw.group_size) else pw
    if act_dtype in (torch.bfloat16, torch.float32) and pw.out_features % PANEL == 0 \
            and (pw.format != "fp8" or pw.offsets is None) \
            and torch.ops.pagoda.quant_panels_supported(pw.in_features, pw.group_size):
        return pw.panels16()
    if act_dtype in (torch.bfloat16, torch.float32) and pw.out_features % vpanel_width() == 0 \
            and (pw.format != "fp8" or pw.offsets is None) \
            and torch.ops.pagoda.quant_vpanels_supported(pw.in_features, pw.group_size):
        return pw.vpanels(vpanel_width())
    return pw


def cpp_supported(pw: PackedWeight) -> bool:
    k, g = pw.in_features, pw.group_size
    if pw.format == "gguf":
        return pw.layout == "vpanels" and pw.data.device.type == "cpu" and kernel_available()
    if pw.layout == "panels16":
        return pw.data.device.type == "cpu" and kernel_available() and torch.ops.pagoda.quant_panels_supported(k, g)
    if pw.layout == "rows_a8":
        return pw.data.device.type == "cpu" and kernel_available() and torch.ops.pagoda.int4a8_supported(k, g)
    if pw.layout == "vpanels":
        return pw.data.device.type == "cpu" and kernel_available() and torch.ops.pagoda.quant_vpanels_supported(k, g) \
            and pw.scales.shape[2] == vpanel_width()
    return pw.data.device.type == "cpu" and kernel_available() and torch.ops.pagoda.quant_linear_supported(k, g)


def quant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None,
                 use_cpp: bool | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(pw)^T (+ bias), in x's dtype. `use_cpp`: cpp_supported(pw), precomputed per layer."""
    if use_cpp is None:
        use_cpp = cpp_supported(pw)
    if x.dim() != 2:
        return quant_linear(x.reshape(-1, x.shape[-1]), pw, bias, use_cpp).reshape(*x.shape[:-1], -1)
    if use_cpp and x.shape[0] > 0 and x.device.type == "cpu":
        # Returns x's dtype (fp32 accumulation, one rounding on output). Bias is fp32 (Linear.set_quantized).
        b = None if bias is None else bias.float().contiguous()
        if pw.format == "gguf":
            if x.dtype in (torch.bfloat16, torch.float32):
                if pw.gguf_driver == "int8":
                    return torch.ops.pagoda.gguf_a8_linear(x.contiguous(), pw.data, pw.scales, b)
                return torch.ops.pagoda.gguf_vpanel_linear(x.contiguous(), pw.data, pw.scales, b,
                                                           pw.amx and x.dtype == torch.bfloat16)
        elif pw.layout == "vpanels":
            return torch.ops.pagoda.quant_vpanel_linear(x.contiguous(), pw.data, pw.scales, pw.offsets, b,
                                                        pw.group_size, pw.code - FIRST_VPANEL_CODE)
        if pw.layout != "panels16":
            return torch.ops.pagoda.quant_linear(x.contiguous(), pw.data, pw.scales, pw.offsets, b, pw.code,
                                                 pw.group_size)
        if x.dtype in (torch.bfloat16, torch.float32):
            return torch.ops.pagoda.quant_panel_linear(x.contiguous(), pw.data, pw.scales, pw.offsets, b,
                                                       pw.group_size, pw.code - FIRST_PANEL_CODE)
    return dequant_linear(x, pw, bias)


def dequant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, use_cpp: bool = False) -> torch.Tensor:
    """Dequantize to x's dtype (the C++ kernel where `use_cpp` and the build has it, else PackedWeight.dequantize,
    the reference) and multiply: the torch fallback."""
    if use_cpp and pw.format != "gguf" and pw.layout not in ("panels16", "vpanels") and x.device.type == "cpu" \
            and x.dtype in (torch.float32, torch.bfloat16):
        w = torch.ops.pagoda.quant_dequantize(pw.data, pw.scales, pw.offsets, pw.code, pw.group_size,
                                              pw.in_features, x.dtype)
    else:
        w = pw.dequantize(x.dtype)
    return dense_linear(x, w, None if bias is None else bias.to(x.dtype))
