"""The kernel one linear layer runs, chosen once when its weights are final (`choose_linear_kernel`).

A record holds everything the choice decided: the weight in the chosen kernel's layout, the format's code
(linear_formats.py, the table C++ shares), whether the C++ kernels run it, and how many rows the C++
decoder stack may run with it. `Linear.forward` calls the record and `Linear.stack_args` reads it, so no
caller branches on formats again.

Where several kernels can serve a layer at every row count (dense: panels or oneDNN; quantized: panels16 or
vpanels, and the row-major kernel) and the policy carries a tuner (config kernel_tuning="auto"), the tuner picks
among them per shape (kernels/tuning.py); without one, the built-in order stands (the first candidate).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pagoda.kernels.decoder_stack import LinearArgs
from pagoda.kernels.linear import ANY_M, SMALL_M, linear, onednn_runs, panel_pack, prepack, small_m_supported
from pagoda.kernels.linear_formats import DENSE, PANELS
from pagoda.kernels.policy import KernelPolicy
from pagoda.kernels.quant_linear import PackedWeight, cpp_supported, kernel_layout, quant_linear, vpanel_width
from pagoda.kernels.tuning import KernelTuner, TuningEntry, TuningShape


@dataclass(frozen=True)
class LinearKernel:
    code: int                         # the format's code (linear_formats.LINEAR_FORMATS)
    weight: torch.Tensor | None       # dense: the float weight [N, K] (the reference every path equals)
    qweight: PackedWeight | None      # quantized: the codes in the kernel's layout
    bias: torch.Tensor | None
    cpp: bool = False                 # the C++ kernels run it (dense: the few-row streaming kernel)
    panels: torch.Tensor | None = None  # dense: the weight in packed_linear's panels, used at every row count
    onednn: torch.Tensor | None = None  # dense without panels: oneDNN's layout, used at every row count
    stack_rows: int = 0               # the C++ decoder stack runs steps up to this many rows with it (0: never)
    tuning: TuningEntry | None = field(default=None, compare=False)  # the measurement that chose it, if one did
    # x -> x @ W^T + b through the chosen kernel: bound once, so a call does no dispatch of its own
    run: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        run = functools.partial(quant_linear, pw=self.qweight, bias=self.bias, use_cpp=self.cpp) \
            if self.qweight is not None else \
            functools.partial(linear, weight=self.weight, bias=self.bias, small_m_ok=self.cpp, packed=self.onednn,
                              panels=self.panels)
        object.__setattr__(self, "run", run)

    def stack_args(self) -> LinearArgs | None:
        """The layer as the C++ decoder stack takes it; None where its few-row path is not a C++ kernel."""
        if not self.stack_rows:
            return None
        pw = self.qweight
        if pw is not None:
            return [pw.data, pw.scales, pw.offsets, self.bias], self.code, pw.group_size, self.stack_rows
        return [self.panels if self.code == PANELS else self.weight, None, None, self.bias], self.code, 0, \
            self.stack_rows


def choose_linear_kernel(weight: torch.Tensor | None, qweight: PackedWeight | None, bias: torch.Tensor | None,
                         act_dtype: torch.dtype, policy: KernelPolicy) -> LinearKernel:
    """The kernel for a float `weight` or a quantized `qweight` at activations of `act_dtype` under `policy`:
    quantized weights take the layout their CPU kernel reads (kernel_layout: panels16, interleave8), which it runs
    at every row count; float weights are panel-packed where packed_linear takes them, else run oneDNN on a
    prepacked copy. Each layer keeps one kernel at every row count (batch invariance, kernels/linear.py); the
    few-row streaming kernel only serves where oneDNN is missing."""
    if qweight is not None:
        pw = kernel_layout(qweight, act_dtype, policy.quant_activations) if policy.cpp else qweight
        cpp = policy.cpp and cpp_supported(pw)
        if policy.tuner is not None and cpp and pw.layout in ("panels16", "vpanels") and pw.format != "gguf" \
                and torch.ops.pagoda.quant_linear_supported(pw.in_features, pw.group_size):  # the row-major kernel's
            fmt = pw.format + ("+off" if pw.offsets is not None else "")
            shape = TuningShape(fmt, pw.out_features, pw.in_features, pw.group_size, act_dtype)
            # built only for a candidate that is measured or chosen (a cached choice builds that one alone)
            row_major = functools.cache(lambda: qweight if qweight.layout == "rows" else pw.row_major())
            candidates = {pw.layout: functools.partial(_quantized, pw, bias)}
            width = vpanel_width()
            if pw.layout == "panels16" and pw.out_features % width == 0 \
                    and (pw.format != "fp8" or pw.offsets is None):  # the portable panels serve it too
                candidates["vpanels"] = lambda: _quantized(row_major().vpanels(width), bias)
            candidates["rows"] = lambda: _quantized(row_major(), bias)
            return _tuned(policy.tuner, shape, candidates)
        return LinearKernel(pw.code, None, pw, bias, cpp, stack_rows=ANY_M if cpp else 0)
    assert weight is not None
    if not policy.cpp:
        return LinearKernel(DENSE, weight, None, bias, onednn=prepack(weight))  # oneDNN's layout: torch's own
    panels = panel_pack(weight)
    if panels is not None:
        if policy.tuner is not None and onednn_runs(weight.dtype):
            shape = TuningShape(str(weight.dtype).removeprefix("torch."), *weight.shape, 0, act_dtype)
            return _tuned(policy.tuner, shape, {
                "panels": lambda: LinearKernel(PANELS, weight, None, bias, panels=panels, stack_rows=ANY_M),
                "onednn": functools.partial(_without_panels, weight, bias)})
        return LinearKernel(PANELS, weight, None, bias, panels=panels, stack_rows=ANY_M)
    return _without_panels(weight, bias)


def _without_panels(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel:
    """A dense weight where the panel kernel does not serve it (or the tuner chose against it): oneDNN on a prepacked
    copy at every row count, or the few-row streaming kernel where oneDNN is missing."""
    onednn = prepack(weight)
    small_m = onednn is None and weight.device.type == "cpu" and weight.is_contiguous() \
        and small_m_supported(weight.dtype, weight.shape[1])
    return LinearKernel(DENSE, weight, None, bias, small_m, onednn=onednn, stack_rows=SMALL_M if small_m else 0)


def _quantized(pw: PackedWeight, bias: torch.Tensor | None) -> LinearKernel:
    """A quantized weight's C++ kernel in `pw`'s layout, at every row count."""
    return LinearKernel(pw.code, None, pw, bias, True, stack_rows=ANY_M)


def _tuned(tuner: KernelTuner, shape: TuningShape, candidates: Mapping[str, Callable[[], LinearKernel]]) \
        -> LinearKernel:
    """The candidate `tuner` chooses for `shape`, holding the entry that chose it (what `pagoda bench` prints)."""
    kernel, entry = tuner.choose(shape, candidates)
    return dataclasses.replace(kernel, tuning=entry)
