"""AWQ: activation-aware per-input-channel scaling before INT4 rounding.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight Quantization
for LLM Compression and Acceleration", MLSys 2024 (arXiv:2306.00978).

A few input channels carry much larger activations than the rest, and the weights that multiply
them matter most. Scaling such a column of W up by s > 1 (and its input down by 1/s) leaves the
float output unchanged but shrinks its relative rounding error. Per group of linears that share an
input (q/k/v after input_layernorm; gate/up after post_attention_layernorm; down after up_proj;
o after v_proj when their shapes match, i.e. not under GQA), AWQ:
- takes s = mean|x|^alpha per input channel (normalised), for alpha on a 20-point grid in [0, 1)
  (alpha = 0 is plain RTN, so the search never does worse on its own objective);
- keeps the s whose RTN-quantized W*s gives the smallest output MSE on calibration inputs (here the
  MSE of the group's linear outputs);
- folds 1/s into the preceding RMSNorm weight or the preceding linear's rows, so the float model is
  unchanged and only weights carry the scale; no extra tensors are stored;
- optionally (the paper's weight clipping) searches, per (row, group), a shrink of the clipping
  range that minimises the group's output error; as in the reference, q/k are not clipped;
- optionally (`gptq=True`; the paper's section 5.4 shows AWQ and GPTQ combine) also rounds each scaled
  linear with GPTQ on the same calibration inputs, and keeps whichever of that and RTN-with-clipping
  has the lower output error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.quantization.calibration import LayerInputs, capture_inputs
from pagoda.quantization.gptq import HessianAccumulator, gptq_quantize
from pagoda.quantization.int4_format import (
    Int4Weight,
    dequantize_codes,
    effective_group_size,
    group_params,
    pack_int4,
    quantize_codes,
)

N_GRID = 20
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # 1.0 .. 0.55


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input, and where 1/s is folded: a norm weight or a linear's output rows."""

    linears: tuple[str, ...]
    prev: str
    prev_is_norm: bool


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    groups = [ScaleGroup(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", True)]
    v, o = layer.get_submodule("self_attn.v_proj"), layer.get_submodule("self_attn.o_proj")
    if v.out_features == o.in_features:  # under GQA, v's rows are shared by several heads' o columns
        groups.append(ScaleGroup(("self_attn.o_proj",), "self_attn.v_proj", False))
    groups.append(ScaleGroup(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", True))
    groups.append(ScaleGroup(("mlp.down_proj",), "mlp.up_proj", False))
    return groups


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """RTN INT4 then back to float, W [N, K]."""
    g = effective_group_size(w.shape[1], group_size)
    s, z = group_params(w, g)
    return dequantize_codes(quantize_codes(w, s, z, g), s, z, g)


def output_mse(d: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Mean over tokens and output rows of (x . d_n)^2 for a weight error D [N, K], given the input
    second moment cov = X^T X / T [K, K]: trace(D cov D^T) / N. The same number as computing
    X @ D^T and squaring it, at N*K*K instead of T*N*K multiply-adds (T is thousands of tokens)."""
    return ((d @ cov) * d).sum() / d.shape[0]


def search_scale(x: torch.Tensor, x_absmean: torch.Tensor, weights: list[torch.Tensor],
                 group_size: int = 128, n_grid: int = N_GRID) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale s [K] (and its alpha) minimising the MSE of x @ (Q(W*s)/s - W)^T."""
    w = torch.cat(weights, dim=0).float()
    xf = x.float()
    cov = xf.T @ xf / xf.shape[0]
    best = (float("inf"), torch.ones_like(x_absmean), 0.0)
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_absmean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = output_mse(fake_quantize(w * s, group_size) / s - w, cov).item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Per (row, group) clip bound [N, G] (a shrink of max|w|) minimising that group's output error
    (the group's own input second moment, as in output_mse)."""
    n, k = w.shape
    g = effective_group_size(k, group_size)
    wg = w.float().reshape(n, k // g, g)
    xg = x.float().reshape(-1, k // g, g)
    cov = torch.einsum("tgi,tgj->gij", xg, xg) / xg.shape[0]  # [G, g, g]
    full = wg.abs().amax(-1)
    best_err = torch.full_like(full, float("inf"))
    best = full.clone()
    for r in CLIP_RATIOS:
        bound = full * r
        cw = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1)).reshape(n, k)
        d = fake_quantize(cw, g).reshape(n, k // g, g) - wg
        err = (torch.einsum("ngi,gij->ngj", d, cov) * d).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, bound, best)
    return best


def rtn_with_clip(w: torch.Tensor, group_size: int, bound: torch.Tensor | None = None) -> Int4Weight:
    n, k = w.shape
    g = effective_group_size(k, group_size)
    if bound is not None:
        b = bound.repeat_interleave(g, dim=1)
        w = torch.maximum(torch.minimum(w, b), -b)
    s, z = group_params(w, g)
    return Int4Weight(pack_int4(quantize_codes(w, s, z, g)), s, z, g)


def apply_scale(layer: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """W[:, k] *= s[k] for the group's linears, and 1/s into what produces their input: the float
    function of the layer is unchanged."""
    with torch.no_grad():
        for name in group.linears:
            layer.get_submodule(name).weight.mul_(s.unsqueeze(0))
        prev = layer.get_submodule(group.prev)
        if group.prev_is_norm:
            prev.weight.div_(s)
        else:
            prev.weight.div_(s.unsqueeze(1))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(s)


@dataclass
class _Stats:
    """Per group input: sum |x| over all tokens, and an evenly strided subsample of rows."""

    abs_sum: torch.Tensor | None = None
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)


def awq_layer_quantizer(group_size: int = 128, clip: bool = True, max_tokens: int = 4096,  # noqa: ANN201
                        gptq: bool = False, act_order: bool = False):
    """A LayerQuantizer for quantize_sequentially: search and fold every group's scale, then
    (optionally) search clipping, then RTN-quantize each linear (or GPTQ, where `gptq` and lower error)."""

    def quantize_layer(_index: int, layer: nn.Module, inputs: LayerInputs) -> dict[str, Int4Weight]:
        groups = scale_groups(layer)
        total = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
        step = max(1, total // max_tokens)
        stats = {grp.linears[0]: _Stats() for grp in groups}
        stats.setdefault("self_attn.o_proj", _Stats())  # quantized (and clipped) even when not scaled

        def sink(name: str, x: torch.Tensor) -> None:
            st = stats[name]
            a = x.abs().sum(0)
            st.abs_sum = a if st.abs_sum is None else st.abs_sum + a
            st.count += x.shape[0]
            st.rows.append(x[::step].clone())

        with capture_inputs(layer, tuple(stats), sink):
            inputs.feed(layer)
        group_inputs: dict[str, torch.Tensor] = {}
        for grp in groups:
            st = stats[grp.linears[0]]
            assert st.abs_sum is not None
            x = torch.cat(st.rows)
            weights = [layer.get_submodule(n).weight.data for n in grp.linears]
            s, _alpha = search_scale(x, st.abs_sum / st.count, weights, group_size)
            apply_scale(layer, grp, s)
            for n in grp.linears:
                group_inputs[n] = x / s  # what the linear now sees
        if "self_attn.o_proj" not in group_inputs:
            group_inputs["self_attn.o_proj"] = torch.cat(stats["self_attn.o_proj"].rows)
        out: dict[str, Int4Weight] = {}
        for name, x in group_inputs.items():
            lin = layer.get_submodule(name)
            w = lin.weight.data
            bound = None
            if clip and name not in ("self_attn.q_proj", "self_attn.k_proj"):
                bound = search_clip(x, w, group_size)
            q = rtn_with_clip(w, group_size, bound)
            if gptq:
                acc = HessianAccumulator(w.shape[1])
                acc.add(x)
                hessian = acc.hessian()  # 2 X^T X / T, so cov = X^T X / T is half of it
                alt = gptq_quantize(w, hessian, group_size, act_order)
                cov, wf = (hessian / 2).float(), w.float()
                if output_mse(alt.dequantize() - wf, cov) < output_mse(q.dequantize() - wf, cov):
                    q = alt
            lin.weight.data.copy_(q.dequantize(w.dtype))
            out[name] = q
        return out

    return quantize_layer


def rtn_layer_quantizer(group_size: int = 128):  # noqa: ANN201
    """Plain round-to-nearest, as a LayerQuantizer (needs no calibration data)."""

    def quantize_layer(_index: int, layer: nn.Module, _inputs: LayerInputs) -> dict[str, Int4Weight]:
        out = {}
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear):
                q = rtn_with_clip(mod.weight.data, group_size)
                mod.weight.data.copy_(q.dequantize(mod.weight.dtype))
                out[name] = q
        return out

    return quantize_layer
