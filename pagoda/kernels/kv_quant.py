"""KV cache storage formats (`kv_cache_dtype`): the compute dtype, or 8-bit with a scale per (token, kv head).

Tokens reach the cache one chunk or one decode step at a time, so a scale fixed per block at its first
write would clip later tokens. Each (token slot, kv head) row of D values gets its own symmetric scale
amax / qmax instead, kept in fp32 beside the pool: [num_blocks, Hkv, block_size] per layer for K and V
(4 bytes per D bytes: 6% at D = 64). Attention dequantizes rows on read: value = stored * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")

_QUANT = {  # name -> (storage dtype, largest magnitude the format holds)
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheFormat:
    name: str              # one of KV_CACHE_DTYPES
    dtype: torch.dtype     # element dtype of the K/V pool tensors
    qmax: float | None     # None: stored as is, no scales

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes one (token, kv head) row of K (or V) takes, its scale included."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quantized else 0
        return head_dim * elem + scale


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_format(name: str, compute_dtype: torch.dtype) -> KVCacheFormat:
    """Resolve `kv_cache_dtype` for a model computing in `compute_dtype` ("auto" stores that dtype)."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return KVCacheFormat(name, compute_dtype, None)
    dtype, qmax = _QUANT[name]
    return KVCacheFormat(name, dtype, qmax)


def _qmax(dtype: torch.dtype) -> float:
    for d, qmax in _QUANT.values():
        if d == dtype:
            return qmax
    raise ValueError(f"not a quantized KV dtype: {dtype}")


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x / scale in `dtype` [..., D], fp32 scale [...]) with scale = amax(|row|) / qmax.

    The C++ write kernel (fused_ops.cpp write_kv_) does the same arithmetic: fp32 divide, round to
    nearest even, clamp to +-qmax (torch's fp8 casts round to nearest even; e5m2 overflows to inf).
    """
    qmax = _qmax(dtype)
    xf = x.float()
    scale = xf.abs().amax(-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stores zeros
    y = (xf / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype), scale.to(SCALE_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stored rows [..., D] and their scales [...] -> fp32 values."""
    return q.float() * scale.float().unsqueeze(-1)
