"""GPTQ: Hessian-aware INT4 weight quantization with error feedback.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023 (arXiv:2210.17323).

For a linear layer y = W x with calibration inputs X, GPTQ minimises ||W X - Q X||^2 row by row. The
proxy Hessian of that objective is H = 2 X X^T. Columns are quantized one at a time; the rounding
error of column j, scaled by the inverse Hessian, is pushed onto the columns not yet quantized so
they compensate for it (Optimal Brain Quantization). The paper's practical form, used here:
- dampening: H += percdamp * mean(diag H) * I, for a stable inverse;
- the needed rows of H^-1 come from the upper Cholesky factor of H^-1, computed once;
- "lazy batch" updates: columns are processed in blocks of 128, errors within a block are applied
  at once, and the rest of the matrix is updated once per block;
- act-order (optional): columns in order of descending diag(H), the most sensitive first. Here the
  group scales/zeros are then fixed up front from the original column order ("static groups"), so
  the checkpoint keeps groups contiguous and needs no g_idx.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.quantization.calibration import LINEAR_GROUPS, LayerInputs, capture_inputs
from pagoda.quantization.int4_format import (
    Int4Weight,
    effective_group_size,
    group_params,
    pack_int4,
    round_codes,
)


@dataclass
class HessianAccumulator:
    """Running H = 2/n * sum x x^T over the n calibration rows seen so far."""

    columns: int
    sum_xxt: torch.Tensor | None = None
    rows: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.columns).double()
        if self.sum_xxt is None:
            self.sum_xxt = torch.zeros(self.columns, self.columns, dtype=torch.float64)
        self.sum_xxt.addmm_(x.T, x)
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.sum_xxt is None or self.rows == 0:
            raise ValueError("no calibration inputs reached this layer")
        return (2.0 / self.rows) * self.sum_xxt


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, act_order: bool = False,
                  percdamp: float = 0.01, blocksize: int = 128) -> Int4Weight:
    """GPTQ-quantize W [N, K] given H [K, K]; returns the INT4 weight (groups in original column order)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    g = effective_group_size(k, group_size)
    h = hessian.detach().double().clone()
    dead = torch.diag(h) == 0  # inputs that are always zero: any value works, make it zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    scales = torch.empty(n, k // g)
    zeros = torch.empty(n, k // g)
    if act_order:
        # Static groups: every group's grid is fixed from the original weights before any update.
        s, z = group_params(w, g)
        scales[:], zeros[:] = s, z
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    group_of = perm // g  # the (original-order) group of each permuted column

    h.diagonal().add_(percdamp * torch.mean(torch.diag(h)))
    # The inverse in fp64 (ill-conditioned H); the column loop in fp32, as in the paper's code.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    codes = torch.empty(n, k)
    with _threads(max(1, min(torch.get_num_threads(), n // 2048))):
        _quantize_columns(w, hinv, codes, scales, zeros, group_of, g, act_order, blocksize)
    codes = codes[:, torch.argsort(perm)]
    return Int4Weight(pack_int4(codes.to(torch.uint8)), scales, zeros, g)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """The column loop is thousands of small ops: extra intra-op threads only add sync overhead
    (and on shared cores the threads wait on each other), so it runs on few threads unless the rows are many."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _quantize_columns(w: torch.Tensor, hinv: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, group_of: torch.Tensor, g: int, act_order: bool, blocksize: int) -> None:
    """The blocked GPTQ pass over (permuted) columns; fills codes and, without act-order, the lazy grids."""
    k = w.shape[1]
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            grp = int(group_of[col])
            if not act_order and col % g == 0:
                # Lazy grid: taken from the weights as updated by the error feedback so far.
                ahead = w1[:, i:i + g] if i + g <= i2 - i1 else torch.cat((w1[:, i:], w[:, i2:col + g]), dim=1)
                s, z = group_params(ahead, g)
                scales[:, grp], zeros[:, grp] = s[:, 0], z[:, 0]
            s, z = scales[:, grp], zeros[:, grp]
            wc = w1[:, i]
            q = round_codes(wc, s, z)
            codes[:, col] = q
            err = (wc - (q - z) * s) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]


def gptq_layer_quantizer(group_size: int = 128, act_order: bool = False, percdamp: float = 0.01):  # noqa: ANN201
    """A LayerQuantizer for quantize_sequentially: the layer's linears group by group in data-flow
    order, each group calibrated on inputs that already pass through the earlier quantized groups."""

    def quantize_layer(_index: int, layer: nn.Module, inputs: LayerInputs) -> dict[str, Int4Weight]:
        out: dict[str, Int4Weight] = {}
        for names in LINEAR_GROUPS:
            acc = {name: HessianAccumulator(layer.get_submodule(name).in_features) for name in names}
            with capture_inputs(layer, names, lambda name, x, acc=acc: acc[name].add(x), stop=True):
                inputs.feed(layer)
            for name in names:
                lin = layer.get_submodule(name)
                q = gptq_quantize(lin.weight.data, acc[name].hessian(), group_size, act_order, percdamp)
                lin.weight.data.copy_(q.dequantize(lin.weight.dtype))
                out[name] = q
        return out

    return quantize_layer
