"""Linear layer whose matmul goes through pagoda.kernels (the seam quantized layers plug into)."""
from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels.decoder_stack import LinearArgs
from pagoda.kernels.linear import PANELS_STACK_MAX_M, SMALL_M, linear, panel_pack, prepack, small_m_supported
from pagoda.kernels.linear_formats import DENSE, PANELS
from pagoda.kernels.policy import KernelPolicy
from pagoda.kernels.quant_linear import (
    CPP_MAX_M,
    FORMATS,
    PANEL_FORMATS,
    PackedWeight,
    cpp_supported,
    kernel_layout,
    quant_linear,
)


class Linear(nn.Linear):
    """nn.Linear with a decode-friendly kernel; call `prepare()` once weights are final.

    `set_quantized()` swaps the float weight for a PackedWeight (pagoda.quantization); forward then
    runs pagoda.kernels.quant_linear."""

    small_m_ok: bool = False
    packed: torch.Tensor | None = None  # oneDNN layout of the float weight (kernels.linear.prepack)
    panels: torch.Tensor | None = None  # or the weight in packed_linear's panels (kernels.linear.panel_pack)
    qweight: PackedWeight | None = None
    quant_cpp_ok: bool = False

    def set_quantized(self, pw: PackedWeight) -> None:
        if (pw.out_features, pw.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {(pw.out_features, pw.in_features)} != layer "
                             f"{(self.out_features, self.in_features)}")
        self.qweight = pw
        # Drop the float weight (a tied lm_head only drops its reference to the embedding).
        self.register_parameter("weight", None)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)

    def prepare(self, act_dtype: torch.dtype, policy: KernelPolicy) -> None:
        """`act_dtype`: the model's compute dtype, which picks the quantized kernel (kernel_layout); `policy`:
        whether the C++ kernels may run at all."""
        if self.qweight is not None:
            if policy.cpp:
                self.qweight = kernel_layout(self.qweight, act_dtype, policy.int4_activations)
            self.quant_cpp_ok = policy.cpp and cpp_supported(self.qweight)
            return
        w = self.weight
        self.panels = panel_pack(w) if policy.cpp else None
        if not policy.cpp:
            self.packed = prepack(w)  # oneDNN's layout: torch's own
        elif self.panels is None:
            self.small_m_ok = w.device.type == "cpu" and w.is_contiguous() and small_m_supported(w.dtype, w.shape[1])
            self.packed = prepack(w)

    def stack_args(self) -> LinearArgs | None:
        """This layer as the C++ decoder stack takes it (kernels/decoder_stack.py), after prepare();
        None where its few-row path is not a C++ streaming kernel."""
        pw = self.qweight
        if pw is not None:
            if not self.quant_cpp_ok:
                return None
            max_rows = PANELS_STACK_MAX_M if pw.fmt in PANEL_FORMATS else CPP_MAX_M  # panels: one kernel at every M
            return [pw.data, pw.scales, pw.offsets, self.bias], FORMATS[pw.fmt], pw.group_size, max_rows
        if self.panels is not None:
            return [self.panels, None, None, self.bias], PANELS, 0, PANELS_STACK_MAX_M
        return ([self.weight, None, None, self.bias], DENSE, 0, SMALL_M) if self.small_m_ok else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return quant_linear(x, self.qweight, self.bias, self.quant_cpp_ok)
        return linear(x, self.weight, self.bias, self.small_m_ok, self.packed, self.panels)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
