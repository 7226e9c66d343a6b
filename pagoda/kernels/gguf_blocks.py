"""GGUF's block formats held as stored (PackedWeight format "gguf"): one table row per GGML type says how its
blocks split into codes and fields; one packer regroups any row's blocks into the portable panels the C++ kernel reads
(cpu/gguf_blocks.h, whose Traits mirror this table), with the same bits and no others.

A "gguf" weight is a list of segments, each of one GGML type (a fused q|k|v may hold Q4_K and Q6_K parts): `data`
uint8 [bytes] holds them one after another, `scales` is the segment table int64 [S, 3] of (GGML type, output rows,
byte offset). Layout "rows": each segment's GGUF rows as the file stores them; "vpanels": per panel of P output
columns and per super-block, the P columns' fields (d, dmin or Q4_1/Q5_1's m, sub-block scales, mins: each
[count][P]), their low nibbles [block][P / 2] (byte j: column j low, j + P / 2 high) and the code bits above them
[block][P * high / 8] (then [block][P * top / 8]); 8-bit codes (Q8_0) as signed bytes [block][P] instead. Types
with 2 or 3 bits a code (Q2_K, Q3_K) have no nibble plane, every code bit in the fields; where the file packs the
sub-block scales (Q2_K's scale and min nibbles, Q3_K's and IQ4_XS's 6-bit scales) the fields are its packed bytes,
the C++ decoder unpacking them per column; MXFP4's field is its E8M0 exponent byte, and the codes of IQ4_NL, IQ4_XS
(IQ4_NL's 16-value grid) and MXFP4 index their type's table.

The table holds Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0, Q2_K, Q3_K, IQ4_XS and MXFP4; all but
Q4_0, Q4_1 and Q8_0 are kept as blocks on their own, those three only fused beside other GGUF blocks
(quantization/gguf_native.py, PackedWeight.cat).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import Q4_K as _Q4_K
from gguf.quants import dequantize as _gguf_dequantize

# raw blocks uint8 [B, type_size] -> (unsigned codes uint8 [B, block], fields [B, count] in the panel's order)
Split = Callable[[np.ndarray], tuple[np.ndarray, list[np.ndarray]]]


@dataclass(frozen=True)
class GgufBlock:
    block: int       # weights per super-block
    group: int       # weights per sub-block scale
    high_bits: int   # code bits above the low nibble (4: whole signed bytes)
    split: Split
    low_bits: int = 4  # code bits in the nibble plane (0: no plane, the fields from bit 0)
    top_bits: int = 0  # code bits of a second field, above high_bits'


def _u16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.uint16)


def _nibble_pairs(qs: np.ndarray, runs: int, run: int) -> np.ndarray:
    """K-quant nibble order: `runs` runs of `run` bytes, each the low nibbles of `run` weights then the high ones."""
    q = (qs.reshape(-1, runs, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    return q.reshape(qs.shape[0], -1)


def _bit_planes(packed: np.ndarray, rows: int, shift: int, width: int) -> np.ndarray:
    """Fields of `width` bits: `rows` rows of bytes, field s of a byte at bit shift * s, weights row-major."""
    shifts = np.arange(0, 8, shift, dtype=np.uint8).reshape(1, 1, -1, 1)
    f = (packed.reshape(packed.shape[0], rows, 1, -1) >> shifts) & ((1 << width) - 1)
    return f.reshape(packed.shape[0], -1)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    sc, m = _Q4_K.get_scale_min(b[:, 4:16].copy())
    return _nibble_pairs(b[:, 16:144], 4, 32), [_u16(b[:, 0:2]), _u16(b[:, 2:4]), sc, m]


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    sc, m = _Q4_K.get_scale_min(b[:, 4:16].copy())
    high = _bit_planes(b[:, 16:48], 1, 1, 1)  # bit s of byte j: weight 32 s + j
    return _nibble_pairs(b[:, 48:176], 4, 32) | (high << 4), [_u16(b[:, 0:2]), _u16(b[:, 2:4]), sc, m]


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    low = _nibble_pairs(b[:, 0:128], 2, 64)
    high = _bit_planes(b[:, 128:192], 2, 2, 2)  # half h, bits 2 s of byte j: weight 128 h + 32 s + j
    return low | (high << 4), [_u16(b[:, 208:210]), b[:, 192:208].copy()]


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")
    return _nibble_pairs(b[:, 6:22], 1, 16) | (high << 4), [_u16(b[:, 0:2])]


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    high = np.unpackbits(b[:, 4:8], axis=-1, bitorder="little")
    return _nibble_pairs(b[:, 8:24], 1, 16) | (high << 4), [_u16(b[:, 0:2]), _u16(b[:, 2:4])]


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    return _nibble_pairs(b[:, 2:18], 1, 16), [_u16(b[:, 0:2])]


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    return _nibble_pairs(b[:, 4:20], 1, 16), [_u16(b[:, 0:2]), _u16(b[:, 2:4])]


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    return b[:, 2:34].copy(), [_u16(b[:, 0:2])]  # the int8 codes' bytes


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    # half h, bits 2 s of byte j: weight 128 h + 32 s + j; byte g of the scales: sc low, m high
    return _bit_planes(b[:, 16:80], 2, 2, 2), [_u16(b[:, 80:82]), _u16(b[:, 82:84]), b[:, 0:16].copy()]


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    low = _bit_planes(b[:, 32:96], 2, 2, 2)
    high = _bit_planes(b[:, 0:32], 1, 1, 1)  # hmask: bit s of byte j, weight 32 s + j
    return low | (high << 2), [_u16(b[:, 108:110]), b[:, 96:108].copy()]  # the code q + 4; the 12 scale bytes


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    return _nibble_pairs(b[:, 8:136], 8, 16), [_u16(b[:, 0:2]), b[:, 2:8].copy()]  # scales_h, scales_l as stored


def _mxfp4(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    return _nibble_pairs(b[:, 1:17], 1, 16), [b[:, 0:1].copy()]  # the E8M0 exponent


GGUF_BLOCKS: dict[int, GgufBlock] = {
    int(T.Q4_K): GgufBlock(256, 32, 0, _q4_k),
    int(T.Q5_K): GgufBlock(256, 32, 1, _q5_k),
    int(T.Q6_K): GgufBlock(256, 16, 2, _q6_k),
    int(T.Q5_0): GgufBlock(32, 32, 1, _q5_0),
    int(T.Q5_1): GgufBlock(32, 32, 1, _q5_1),
    int(T.Q4_0): GgufBlock(32, 32, 0, _q4_0),
    int(T.Q4_1): GgufBlock(32, 32, 0, _q4_1),
    int(T.IQ4_NL): GgufBlock(32, 32, 0, _q4_0),  # as Q4_0's bytes: fp16 d, then 4-bit indices into the table
    int(T.Q8_0): GgufBlock(32, 32, 4, _q8_0),
    int(T.Q2_K): GgufBlock(256, 16, 2, _q2_k, low_bits=0),
    int(T.Q3_K): GgufBlock(256, 16, 2, _q3_k, low_bits=0, top_bits=1),
    int(T.IQ4_XS): GgufBlock(256, 32, 0, _iq4_xs),
    int(T.MXFP4): GgufBlock(32, 32, 0, _mxfp4),
}
MAX_PANEL = 32  # the widest build's panel (AVX-512: 2 x 16 lanes): segments of a multiple of it fit every build


def segments(table: torch.Tensor) -> list[tuple[int, int, int]]:
    """(GGML type, rows, byte offset) per segment."""
    return [(int(t), int(r), int(o)) for t, r, o in table.tolist()]


def segment_table(parts: list[tuple[int, int, int]]) -> torch.Tensor:
    return torch.tensor(parts, dtype=torch.int64).reshape(-1, 3)


def row_bytes(qtype: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[T(qtype)]
    return k // block * size


def _rows_of(data: torch.Tensor, qtype: int, rows: int, offset: int, k: int) -> np.ndarray:
    """One "rows" segment as the file stores it: uint8 [rows, bytes per row]."""
    n = row_bytes(qtype, k)
    return data[offset:offset + rows * n].numpy().reshape(rows, n)


def dequantize_rows_layout(data: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """Layout "rows": every segment through gguf-py's own dequantizer, fp32 [N, K] (the reference)."""
    return torch.cat([torch.from_numpy(np.asarray(_gguf_dequantize(_rows_of(data, t, r, o, k), T(t)),
                                                  dtype=np.float32)).reshape(r, k)
                      for t, r, o in segments(table)])


def take_rows(data: torch.Tensor, table: torch.Tensor, index: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout "rows": output rows `index`, in its order, as one segment per run of rows of one type."""
    segs = segments(table)
    starts = np.cumsum([0] + [r for _, r, _ in segs])
    idx = index.reshape(-1).numpy()
    if idx.size and (idx.min() < 0 or idx.max() >= starts[-1]):
        raise IndexError(f"row index out of range for {starts[-1]} rows")
    which = np.searchsorted(starts, idx, side="right") - 1
    chunks, parts, offset, i = [data[:0]], [], 0, 0
    while i < idx.size:
        j = i + 1
        while j < idx.size and which[j] == which[i]:
            j += 1
        t, r, o = segs[which[i]]
        rows = _rows_of(data, t, r, o, k)[idx[i:j] - starts[which[i]]]
        chunks.append(torch.from_numpy(np.ascontiguousarray(rows)).reshape(-1))
        parts.append((t, j - i, offset))
        offset += rows.size
        i = j
    return torch.cat(chunks), segment_table(parts)


def q8_0_from_codes(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """INT8 codes [N, K] with one scale per 32 that is an fp16 number (a Q8_0's codes and scales) as the Q8_0 rows
    they came from, or None where a scale is not an fp16 number."""
    half = scales.half()
    if not torch.equal(half.float(), scales):
        return None
    n, k = codes.shape
    data = torch.cat([half.view(torch.uint8).reshape(n, k // 32, 2), codes.view(torch.uint8).reshape(n, k // 32, 32)],
                     dim=-1)
    return data.reshape(-1), segment_table([(int(T.Q8_0), n, 0)])


def q4_from_codes(codes: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Row-major INT4 codes (two a byte, uint8 [N, K / 2]) with one scale and offset per 32 that are fp16 numbers (a
    Q4_0's or Q4_1's codes and scales) as Q4_0 rows where every offset is -8 times its scale, else Q4_1 rows (the
    same weights: d q + m with d q exact), or None where a scale or offset is not an fp16 number."""
    n, k = codes.shape[0], codes.shape[1] * 2
    m = torch.zeros_like(scales) if offsets is None else offsets
    d, mh = scales.half(), m.half()
    if not (torch.equal(d.float(), scales) and torch.equal(mh.float(), m)):
        return None
    q = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(n, k // 32, 2, 16)  # k order, by halves of a block
    nibbles = q[:, :, 0] | (q[:, :, 1] << 4)  # GGML's order: byte j holds weights j and j + 16
    fields = [d.view(torch.uint8).reshape(n, k // 32, 2)]
    qtype = T.Q4_0 if torch.equal(m, -8 * scales) else T.Q4_1
    if qtype == T.Q4_1:
        fields.append(mh.view(torch.uint8).reshape(n, k // 32, 2))
    return torch.cat([*fields, nibbles], dim=-1).reshape(-1), segment_table([(int(qtype), n, 0)])


def take_columns(data: torch.Tensor, table: torch.Tensor, cols: range, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout "rows": input columns `cols` of every row (whole super-blocks: a tensor-parallel split)."""
    chunks, parts, offset = [], [], 0
    for t, r, o in segments(table):
        block, size = GGML_QUANT_SIZES[T(t)]
        if cols.start % block or len(cols) % block:
            raise ValueError(f"columns {cols.start}..{cols.stop} split a GGUF block of {block}")
        rows = _rows_of(data, t, r, o, k).reshape(r, k // block, size)[:, cols.start // block:cols.stop // block]
        chunks.append(torch.from_numpy(np.ascontiguousarray(rows)).reshape(-1))
        parts.append((t, r, offset))
        offset += rows.size
    return torch.cat(chunks), segment_table(parts)


def to_panels(data: torch.Tensor, table: torch.Tensor, k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout "rows" -> "vpanels" of `width` output columns (the build's 2W), segment by segment."""
    chunks, parts, offset = [], [], 0
    for t, r, o in segments(table):
        packed = _panels(_rows_of(data, t, r, o, k), t, k, width)
        chunks.append(torch.from_numpy(packed))
        parts.append((t, r, offset))
        offset += packed.size
    return torch.cat(chunks), segment_table(parts)


def _panels(raw: np.ndarray, qtype: int, k: int, width: int) -> np.ndarray:
    spec = GGUF_BLOCKS[qtype]
    _, size = GGML_QUANT_SIZES[T(qtype)]
    n, nsb, half = raw.shape[0], k // spec.block, width // 2
    if n % width:
        raise ValueError(f"{n} rows are not whole panels of {width}")
    codes, fields = spec.split(raw.reshape(-1, size))

    def columns_last(a: np.ndarray) -> np.ndarray:  # [N * nsb, c] -> [N / width, nsb, c, width]
        return np.ascontiguousarray(a.reshape(n // width, width, nsb, -1).transpose(0, 2, 3, 1))

    parts = [columns_last(f).view(np.uint8).reshape(n // width, nsb, -1) for f in fields]
    q = columns_last(codes)                                                  # [N / width, nsb, block, width]
    if spec.high_bits == 4:
        return np.concatenate([*parts, q.reshape(n // width, nsb, -1)], axis=-1).reshape(-1)
    if spec.low_bits:
        low = q & 0xF
        parts.append((low[..., :half] | (low[..., half:] << 4)).reshape(n // width, nsb, -1))
    for at, count in ((spec.low_bits, spec.high_bits), (spec.low_bits + spec.high_bits, spec.top_bits)):
        if count:  # column c's bit i at bit c * count + i of each k's field
            bits = (q[..., None] >> np.arange(at, at + count, dtype=np.uint8)) & 1
            bits = bits.reshape(n // width, nsb, spec.block, width * count)
            parts.append(np.packbits(bits, axis=-1, bitorder="little").reshape(n // width, nsb, -1))
    return np.concatenate(parts, axis=-1).reshape(-1)
