"""Run a GGUF's Q4_0 / Q4_1 / Q8_0 tensors natively: raw blocks -> PackedWeight, no float copy.

Each GGML block covers 32 weights of a row:
  Q4_0: fp16 d, 16 bytes of nibbles                w = d * (q - 8)     -> int4, scale d, offset -8d
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles        w = d * q + m       -> int4, scale d, offset m
  Q8_0: fp16 d, 32 int8                            w = d * q           -> int8 groups of 32, scale d
GGML puts element j in the low nibble of byte j and element j + 16 in its high nibble; the nibbles
are repacked into Pagoda's order (low nibble = even k). Both are exact: fp16 d and m are exact in
fp32, and the codes are unchanged, so the kernels compute on gguf-py's dequantized weights.
Other tensor types (F32 norms, K-quants) are dequantized to float as before.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.model.errors import warn_nonfinite
from pagoda.model.gguf_loader import IGNORED_TENSORS, GGUFFile, gguf_to_hf_name, stored_offset, unpermute_qk
from pagoda.model.loader import ModelFiles
from pagoda.quantization.int4_format import pack_int4

Q4_0, Q4_1, Q8_0 = 2, 3, 8
NATIVE = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # qtype -> bytes per block of 32


def packed_from_blocks(raw: np.ndarray, qtype: int, k: int) -> PackedWeight:
    """raw: uint8 [N, K / 32 * block_bytes] as stored -> PackedWeight over [N, K]."""
    n, g = raw.shape[0], k // 32
    blocks = torch.from_numpy(np.array(raw)).view(n, g, NATIVE[qtype])  # owned copy of the mapped bytes
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, g).float()
    if qtype == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return PackedWeight("int8", q.contiguous(), d.contiguous(), None, 32, k)
    if qtype == Q4_1:
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, g).float()
        qs = blocks[..., 4:]
    else:
        offsets = -8.0 * d
        qs = blocks[..., 2:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(n, k)  # GGML order: 16 low, then 16 high
    return PackedWeight("int4", pack_int4(codes).contiguous(), d.contiguous(), offsets.contiguous(), 32, k)


def gguf_native_weights(files: ModelFiles, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """The GGUF as a weight stream: Q4_0/Q4_1/Q8_0 matrices (the embedding table included) as PackedWeights
    in their blocks, everything else dequantized to `dtype`."""
    g: GGUFFile = files._gguf
    cfg = files.hf_config
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    permute = g.architecture == "llama"
    for name, info in g.tensors.items():
        if name in IGNORED_TENSORS:
            continue
        hf = gguf_to_hf_name(name, g.architecture)
        if hf is None:
            raise ValueError(f"{g.path}: GGUF tensor {name!r} has no known HF equivalent")
        n_head = heads if ".attn_q." in name else kv_heads if ".attn_k." in name else 0
        if "{e}" in hf:  # stacked experts [E, rows, cols]: each expert's matrix on its own
            yield from _experts(g, name, hf, dtype)
            continue
        if info.qtype in NATIVE and len(info.dims) == 2 and hf.endswith(".weight"):
            pw = packed_from_blocks(g.raw_tensor(name), info.qtype, info.dims[0])
            if permute and n_head:
                pw = pw.rows(torch.from_numpy(unpermute_qk(np.arange(pw.out_features), n_head)))
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
        yield hf, t


def _experts(g: GGUFFile, name: str, hf: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """A stacked experts tensor [E, rows, cols] as one weight per expert ("{e}" in `hf`): Q4_0/Q4_1/Q8_0 blocks as
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
