"""Run a GGUF's quantized tensors as stored: each type's blocks -> codes and per-group scales and offsets that a
Pagoda kernel format takes exactly (a PackedWeight), no float copy.

Every type below is affine per group: gguf-py dequantizes a weight as scale * code + offset (or scale * code) with
an integer code, a scale and an offset that are exact fp32 numbers (fp16 values times small integers, powers of
two). So one table row per GGML type names its Pagoda format (INT4 where every code fits 4 bits, else INT8), its
group (the type's sub-block: 32, or 16 for Q2_K/Q3_K/Q6_K) and a decoder from raw blocks to (codes, scales,
offsets); the kernels then compute on exactly gguf-py's dequantized weights (tests/test_gguf_types.py):
  Q4_0  fp16 d, nibbles                        w = d * (q - 8)          INT4, offset -8d
  Q4_1  fp16 d, m, nibbles                     w = d * q + m            INT4
  Q5_0  fp16 d, 5th bits, nibbles              w = d * (q - 16)         INT8
  Q5_1  fp16 d, m, 5th bits, nibbles           w = d * q + m            INT8
  Q8_0  fp16 d, int8                           w = d * q                INT8
  Q2_K  256: 16 x (4-bit sc, 4-bit m), 2 bits  w = d sc q - dmin m      INT4, groups of 16
  Q3_K  256: 16 x 6-bit sc, 3 bits             w = d (sc - 32) q        INT4 (q + 4), groups of 16
  Q4_K  256: 8 x (6-bit sc, 6-bit m), 4 bits   w = d sc q - dmin m      INT4
  Q5_K  256: as Q4_K, 5 bits                   w = d sc q - dmin m      INT8
  Q6_K  256: 16 x int8 sc, 6 bits              w = d sc (q - 32)        INT8, groups of 16
  IQ4_NL  fp16 d, 4-bit indices into a table of 16 int8 values                  INT8 (the table's value)
  IQ4_XS  256: 8 x 6-bit sc, IQ4_NL's table    w = d (sc - 32) t[q]     INT8
  MXFP4   E8M0 exponent, 4-bit e2m1 (doubled)  w = 2^(e-128) t[q]       INT8
Other types (the IQ1/IQ2/IQ3 codebooks, ternary) and the float tensors (norms) are dequantized to float.

Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS and MXFP4 are kept in their blocks' own bits instead
(format "gguf", kernels/gguf_blocks.py, which also splits some of their blocks for the decoders here) wherever the
C++ kernels are built and the matrix has whole panels of rows: the table above is their form where they are not.
Q4_0, Q4_1 and Q8_0 have rows in that block table too, but a matrix of one of them alone keeps its codes (the INT4
and INT8 panel kernels', with fp16 scales and offsets in vpanels); fused beside GGUF blocks it joins them as the
blocks it is (PackedWeight.cat).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import IQ4_NL as _IQ4_NL
from gguf.quants import MXFP4 as _MXFP4

from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.gguf_blocks import GGUF_BLOCKS, MAX_PANEL, segment_table
from pagoda.kernels.quant_linear import PackedWeight
from pagoda.model.errors import warn_nonfinite
from pagoda.model.gguf_loader import IGNORED_TENSORS, GGUFFile, gguf_to_hf_name, stored_offset, unpermute_qk
from pagoda.model.loader import ModelFiles
from pagoda.quantization.int4_format import pack_int4

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q8_0)
# One decoder: raw blocks uint8 [B, type_size] -> codes [B, block] (any int dtype), scales [B, block / group]
# float32, offsets like scales or None.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclass(frozen=True)
class BlockType:
    format: str                                  # the Pagoda format its codes fit: "int4" (0..15) or "int8"
    group: int                                   # weights per scale
    decode: Callable[[np.ndarray], Decoded]


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 32-element nibble order: element j in byte j's low nibble, j + 16 in its high one."""
    return np.concatenate((qs & 0xF, qs >> 4), axis=-1)


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8.0 * d


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _half(u16: np.ndarray) -> np.ndarray:
    return u16.view(np.float16).astype(np.float32)


def _q5_0(b: np.ndarray) -> Decoded:
    q, (d,) = GGUF_BLOCKS[int(T.Q5_0)].split(b)
    return q.astype(np.int8) - 16, _half(d), None


def _q5_1(b: np.ndarray) -> Decoded:
    q, (d, m) = GGUF_BLOCKS[int(T.Q5_1)].split(b)
    return q.astype(np.int8), _half(d), _half(m)


def _q8_0(b: np.ndarray) -> Decoded:
    return b[:, 2:34].copy().view(np.int8), _f16(b[:, 0:2]), None


def _q2_k(b: np.ndarray) -> Decoded:
    sc, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)  # element 128 h + 32 s + j
    return q, d * (sc & 0xF).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))


def _q3_k(b: np.ndarray) -> Decoded:
    hmask, qs, packed, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = (packed[:, 0:8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    hi = (packed[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    scales = d * (((lo & 0xF) | ((hi & 3) << 4)).astype(np.float32) - 32)
    low = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    high = (hmask.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    # q = low - 4 (1 - high): the code q + 4 = low + 4 high is unsigned 3 bits.
    return (low.reshape(-1, 256) + 4 * high.reshape(-1, 256)), scales, -4.0 * scales


def _k_scales(fields: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per 32-weight sub-block, scale d * sc and offset -dmin * m."""
    d, dmin, sc, m = fields
    return _half(d) * sc.astype(np.float32), -(_half(dmin) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Decoded:
    q, fields = GGUF_BLOCKS[int(T.Q4_K)].split(b)
    return (q, *_k_scales(fields))


def _q5_k(b: np.ndarray) -> Decoded:
    q, fields = GGUF_BLOCKS[int(T.Q5_K)].split(b)
    return (q.astype(np.int8), *_k_scales(fields))


def _q6_k(b: np.ndarray) -> Decoded:
    q, (d, sc) = GGUF_BLOCKS[int(T.Q6_K)].split(b)
    return q.astype(np.int8) - 32, _half(d) * sc.view(np.int8).astype(np.float32), None


_IQ4_TABLE = np.array(_IQ4_NL.kvalues, dtype=np.int8)
_MXFP4_TABLE = np.array(_MXFP4.kvalues, dtype=np.int8)


def _iq4_nl(b: np.ndarray) -> Decoded:
    return _IQ4_TABLE[_nibbles(b[:, 2:18])], _f16(b[:, 0:2]), None


def _iq4_xs(b: np.ndarray) -> Decoded:
    d, high, low = _f16(b[:, 0:2]), b[:, 2:4].copy().view(np.uint16), b[:, 4:8]
    lo = (low.reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 0xF
    hi = (high.reshape(-1, 1) >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)).astype(np.uint8) & 3
    scales = d * ((lo | (hi << 4)).astype(np.float32) - 32)
    idx = (b[:, 8:136].reshape(-1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    return _IQ4_TABLE[idx.reshape(-1, 256)], scales, None


def _mxfp4(b: np.ndarray) -> Decoded:
    scales = _MXFP4.e8m0_to_fp32_half(b[:, 0:1].copy()).reshape(-1, 1)
    return _MXFP4_TABLE[_nibbles(b[:, 1:17])], scales, None


BLOCK_TYPES: dict[int, BlockType] = {
    int(T.Q4_0): BlockType("int4", 32, _q4_0),
    int(T.Q4_1): BlockType("int4", 32, _q4_1),
    int(T.Q5_0): BlockType("int8", 32, _q5_0),
    int(T.Q5_1): BlockType("int8", 32, _q5_1),
    int(T.Q8_0): BlockType("int8", 32, _q8_0),
    int(T.Q2_K): BlockType("int4", 16, _q2_k),
    int(T.Q3_K): BlockType("int4", 16, _q3_k),
    int(T.Q4_K): BlockType("int4", 32, _q4_k),
    int(T.Q5_K): BlockType("int8", 32, _q5_k),
    int(T.Q6_K): BlockType("int8", 16, _q6_k),
    int(T.IQ4_NL): BlockType("int8", 32, _iq4_nl),
    int(T.IQ4_XS): BlockType("int8", 32, _iq4_xs),
    int(T.MXFP4): BlockType("int8", 32, _mxfp4),
}
NATIVE = frozenset(BLOCK_TYPES)
# Kept in their blocks' bits (stored_weight), where the kernels run them. A Q4_0, Q4_1 or Q8_0 matrix alone keeps its
# INT4 or INT8 codes (the panel kernels', INT8 activations included, which the Q4_1 default model runs); fused beside
# GGUF blocks it joins them as the blocks it is (PackedWeight.cat).
STORED = frozenset(GGUF_BLOCKS) - {Q4_0, Q4_1, Q8_0}


def keeps_blocks(qtype: int, rows: int) -> bool:
    """Whether a matrix of `qtype` with `rows` output rows is kept in its blocks' bits (else packed_from_blocks)."""
    return qtype in STORED and rows % MAX_PANEL == 0 and kernel_available()


def stored_weight(raw: np.ndarray, qtype: int, k: int) -> PackedWeight:
    """raw: uint8 [N, K / block * type_size] as stored -> a "gguf" PackedWeight holding exactly those bytes."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(-1)
    return PackedWeight("gguf", data, segment_table([(qtype, raw.shape[0], 0)]), None, GGUF_BLOCKS[qtype].group, k)


def native_weight(raw: np.ndarray, qtype: int, k: int, keep_blocks: bool = True) -> PackedWeight:
    """raw: uint8 [N, K / block * type_size] as stored -> the PackedWeight the loader makes of it: its blocks' bits
    where `keep_blocks` and keeps_blocks() allow, else its codes."""
    if keep_blocks and keeps_blocks(qtype, raw.shape[0]):
        return stored_weight(raw, qtype, k)
    return packed_from_blocks(raw, qtype, k)


def packed_from_blocks(raw: np.ndarray, qtype: int, k: int) -> PackedWeight:
    """raw: uint8 [N, K / block * type_size] as stored -> PackedWeight over [N, K], exactly gguf-py's values."""
    kind = BLOCK_TYPES[qtype]
    block, type_size = GGML_QUANT_SIZES[T(qtype)]
    n = raw.shape[0]
    codes, scales, offsets = kind.decode(np.ascontiguousarray(raw).reshape(-1, type_size))
    codes = torch.from_numpy(np.ascontiguousarray(codes)).reshape(n, k)

    def groups(t: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32)).reshape(n, k // kind.group)

    data = pack_int4(codes.to(torch.uint8)) if kind.format == "int4" else codes.to(torch.int8)
    return PackedWeight(kind.format, data.contiguous(), groups(scales), None if offsets is None else groups(offsets),
                        kind.group, k)


def gguf_native_weights(files: ModelFiles, dtype: torch.dtype,
                        keep_blocks: bool = True) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """The GGUF as a weight stream: the matrices of the types of BLOCK_TYPES (the embedding table included) as
    PackedWeights, in their blocks' bits where `keep_blocks` and keeps_blocks() allow, else of their codes; everything
    else dequantized to `dtype`. Logs the bytes by type."""
    g: GGUFFile = files._gguf
    cfg = files.hf_config
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    permute = g.architecture == "llama"
    stored: Counter[str] = Counter()    # bytes in the file, by type
    resident: Counter[str] = Counter()  # bytes loaded, by the type they came from
    for name, info in g.tensors.items():
        if name in IGNORED_TENSORS:
            continue
        kind = T(info.qtype).name
        stored[kind] += g.raw_tensor(name).nbytes
        hf = gguf_to_hf_name(name, g.architecture)
        if hf is None:
            raise ValueError(f"{g.path}: GGUF tensor {name!r} has no known HF equivalent")
        n_head = heads if ".attn_q." in name else kv_heads if ".attn_k." in name else 0
        if "{e}" in hf:  # stacked experts [E, rows, cols]: each expert's matrix on its own
            for expert, w in _experts(g, name, hf, dtype):
                resident[kind] += w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()
                yield expert, w
            continue
        if info.qtype in NATIVE and len(info.dims) == 2 and hf.endswith(".weight"):
            pw = native_weight(g.raw_tensor(name), info.qtype, info.dims[0], keep_blocks)
            if permute and n_head:
                pw = pw.rows(torch.from_numpy(unpermute_qk(np.arange(pw.out_features), n_head)))
            resident[kind] += pw.nbytes
            yield hf, pw
            continue
        arr = g.dequantized(name)
        if permute and n_head:
            arr = unpermute_qk(arr, n_head)
        arr = np.array(arr, dtype=np.float32)
        if offset := stored_offset(g.architecture, name):  # Gemma's norms: llama.cpp stores 1 + w
            arr -= offset
        t = torch.from_numpy(arr).to(dtype)
        warn_nonfinite(t, hf, g.path)
        resident[kind] += t.numel() * t.element_size()
        yield hf, t
    logger.info("%s weights by type, in the file -> loaded (%s in their blocks' bits where the kernels run them, %s "
                "as codes and scales, the rest as %s): %s", g.path, "/".join(T(q).name for q in sorted(STORED)),
                "/".join(T(q).name for q in sorted(NATIVE - STORED)), dtype,
                ", ".join(f"{k} {stored[k] / 2**20:.1f} -> {resident[k] / 2**20:.1f} MiB" for k in sorted(stored)))


def _experts(g: GGUFFile, name: str, hf: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """A stacked experts tensor [E, rows, cols] as one weight per expert ("{e}" in `hf`): blocks of BLOCK_TYPES as
    PackedWeights, other types dequantized to `dtype`."""
    info = g.tensors[name]
    if info.qtype in NATIVE:
        raw = g.raw_tensor(name)  # [E, rows, bytes per row]
        for e in range(raw.shape[0]):
            yield hf.format(e=e), packed_from_blocks(raw[e], info.qtype, info.dims[0])
        return
    arr = np.array(g.dequantized(name), dtype=np.float32)
    for e in range(arr.shape[0]):
        t = torch.from_numpy(arr[e]).to(dtype)
        warn_nonfinite(t, hf.format(e=e), g.path)
        yield hf.format(e=e), t
