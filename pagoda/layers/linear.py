"""Linear layer whose matmul goes through pagoda.kernels.linear (the seam quantized layers plug into)."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.linear import linear, small_m_supported


class Linear(nn.Linear):
    """nn.Linear with a decode-friendly kernel; call `prepare()` once weights are final."""

    small_m_ok: bool = False

    def prepare(self) -> None:
        w = self.weight
        self.small_m_ok = w.device.type == "cpu" and w.is_contiguous() and small_m_supported(w.dtype, w.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_m_ok)
