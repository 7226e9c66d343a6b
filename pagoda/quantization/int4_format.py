"""The INT4 group-wise weight format shared by RTN, GPTQ, AWQ and saved checkpoints.

A weight W [N, K] (out, in) is split along K into groups of `group_size` input channels. Each
(row, group) has a float scale s and a float (possibly fractional) zero point z in code units, and every weight is a
4-bit code q in 0..15:  W[n, k] ~= (q[n, k] - z[n, g]) * s[n, g],  g = k // group_size.
Codes are stored two per byte, [N, K // 2] uint8, low nibble = even k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 15
GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, K // 2], packed codes
    scales: torch.Tensor   # fp32 [N, K // group_size]
    zeros: torch.Tensor    # fp32 [N, K // group_size], zero point in code units (may be fractional)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes(), self.scales, self.zeros, self.group_size).to(dtype)


def check_group_size(k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size or group_size % 2:
        raise ValueError(f"int4 group_size {group_size} must be even and divide the input size {k}")


def effective_group_size(k: int, requested: int = 128) -> int:
    """The requested group size, or the largest standard one below it that divides K (SmolLM2's
    hidden size 576 is not a multiple of 128, so its q/k/v and gate/up rows use groups of 64)."""
    for g in (requested, *(g for g in sorted(GROUP_SIZES, reverse=True) if g < requested)):
        if k % g == 0:
            return g
    raise ValueError(f"no int4 group size <= {requested} divides the input size {k}")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> [N, K // 2], low nibble = even column."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> codes [N, K] uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def group_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (scale, zero) per (row, group) of a float weight [N, K]: of two standard
    choices, the one with the smaller squared rounding error in that group.

    - min-max with a fractional zero point (GGUF Q4_1's float minimum): a weight already on a 4-bit
      grid of this group size, e.g. a dequantized Q4_1 model at g32, is reproduced exactly;
    - the zero-including range with an integer zero point, so that 0.0 is exactly representable
      (on SmolLM2 at g64/g128 this alone gives a lower perplexity than min-max alone).
    """
    n, k = w.shape
    check_group_size(k, group_size)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    s_mm = ((hi - lo) / QMAX).clamp(min=1e-8)
    s_iz = ((hi.clamp(min=0) - lo.clamp(max=0)) / QMAX).clamp(min=1e-8)
    cands = [(s_mm, -lo / s_mm), (s_iz, torch.round(-lo.clamp(max=0) / s_iz))]
    errs = [_sq_error(g, s, z) for s, z in cands]
    pick = errs[1] < errs[0]
    return torch.where(pick, cands[1][0], cands[0][0]), torch.where(pick, cands[1][1], cands[0][1])


def _sq_error(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    s, z = s.unsqueeze(-1), z.unsqueeze(-1)
    return ((round_codes(g, s, z) - z) * s - g).pow(2).sum(-1)


def round_codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The INT4 rounding rule, q = clamp(round(w / s + z), 0, 15), as float (s, z broadcast to w)."""
    return torch.clamp(torch.round(w / s + z), 0, QMAX)


def quantize_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round W to codes given per-group (scale, zero): q = clamp(round(w / s + z), 0, 15)."""
    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    return round_codes(w.float(), s, z).to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    return (codes.float() - z) * s


def quantize_int4_rtn(w: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest INT4 with min-max group scales (the baseline GPTQ and AWQ improve on)."""
    scales, zeros = group_params(w, group_size)
    codes = quantize_codes(w, scales, zeros, group_size)
    return Int4Weight(pack_int4(codes), scales, zeros, group_size)
