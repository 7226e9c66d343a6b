"""Which kernels a model's layers may use: decided once from config when the engine starts, handed to
`model.prepare(policy)`, never read again from anywhere else."""
from __future__ import annotations

from dataclasses import dataclass

from pagoda.kernels.cpu_features import has_avx512, has_avx512_bf16

KERNELS = ("auto", "torch")
INT4_ACTIVATIONS = ("float", "int8")


@dataclass(frozen=True)
class KernelPolicy:
    cpp: bool                      # Pagoda's C++ CPU kernels (they built and config allows them)
    # "int8": INT4 layers quantize their activations to INT8 per row and use VNNI dot products (layout
    # interleave8, kernels/quant_linear.py); "float": INT4 stays weight-only.
    int4_activations: str = "float"

    @classmethod
    def resolve(cls, kernels: str = "auto", int4_activations: str = "float") -> KernelPolicy:
        """`kernels`: auto (the C++ kernels where they build, else torch) or torch (torch ops only)."""
        from pagoda.kernels.cpu_extension import kernel_available  # imports torch: the CLI reads the names first

        check_kernels(kernels, int4_activations)
        return cls(cpp=kernels == "auto" and kernel_available(), int4_activations=int4_activations)

    @property
    def kernel_set(self) -> str:
        """Which kernels run, in a word or two: what the start-up log line and /version say."""
        if not self.cpp:
            return "torch fallback"
        if has_avx512_bf16():
            return "avx512_bf16"
        return "avx512" if has_avx512() else "scalar C++ (no AVX-512 paths)"


TORCH_ONLY = KernelPolicy(cpp=False)


def check_kernels(kernels: str, int4_activations: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if int4_activations not in INT4_ACTIVATIONS:
        raise ValueError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}, got {int4_activations!r}")
