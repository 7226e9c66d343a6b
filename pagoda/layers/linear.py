"""Linear layer whose matmul goes through pagoda.kernels (the seam quantized layers plug into)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.decoder_stack import LinearArgs
from pagoda.kernels.linear_kernel import LinearKernel, choose_linear_kernel
from pagoda.kernels.policy import KernelPolicy
from pagoda.kernels.quant_linear import PackedWeight, quant_linear
from pagoda.lora.layer import LoRASlots


class Linear(nn.Linear):
    """nn.Linear whose kernel is chosen once, by `prepare()`, when the weights are final.

    `set_quantized()` swaps the float weight for a PackedWeight (pagoda.quantization); the chosen kernel
    (kernels/linear_kernel.py) then runs pagoda.kernels.quant_linear."""

    qweight: PackedWeight | None = None
    matmul: LinearKernel | None = None  # the kernel this layer runs, chosen by prepare()
    lora: LoRASlots | None = None  # its adapters' updates, added after the base op (lora/layer.py)

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
        """`act_dtype`: the model's compute dtype, which picks the quantized layout (kernel_layout); `policy`:
        whether the C++ kernels may run at all."""
        self.matmul = choose_linear_kernel(self.weight, self.qweight, self.bias, act_dtype, policy)
        if self.qweight is not None:
            self.qweight = self.matmul.qweight  # in the kernel's layout (a tied table is shared in it)

    def stack_args(self) -> LinearArgs | None:
        """This layer as the C++ decoder stack takes it (kernels/decoder_stack.py), after prepare()."""
        return self.matmul.stack_args() if self.matmul is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            y = self.matmul.run(x)
        elif self.qweight is not None:  # before prepare(): the reference paths
            y = quant_linear(x, self.qweight, self.bias, False)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add_to(y, x)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
