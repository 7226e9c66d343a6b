"""RMSNorm (fp32 math, HF's rounding), optionally fused with the residual add."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.fused_ops import rms_norm, rms_norm_torch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = rms_norm

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernel (`cpp`: its KernelPolicy's choice) or torch's twin."""
        self.op = rms_norm if cpp else rms_norm_torch

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`: residual += x (in place) and return the norm of the sum."""
        return self.op(x, self.weight, self.eps, residual)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
