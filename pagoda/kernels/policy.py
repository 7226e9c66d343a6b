"""Which kernels a model's layers may use: decided once from config when the engine starts, handed to
`model.prepare(policy)`, never read again from anywhere else."""
from __future__ import annotations

from dataclasses import dataclass

# auto: the C++ kernels' best build for this CPU (or the one this process already loaded), else torch;
# native / avx2: that build of the kernels (cpu_extension.BUILDS), an error where it cannot run; torch: torch only.
KERNELS = ("auto", "native", "avx2", "torch")
INT4_ACTIVATIONS = ("float", "int8")


@dataclass(frozen=True)
class KernelPolicy:
    cpp: bool                      # Pagoda's C++ CPU kernels (they built and config allows them)
    # "int8": INT4 layers quantize their activations to INT8 per row and use VNNI dot products (layout
    # interleave8, kernels/quant_linear.py); "float": INT4 stays weight-only.
    int4_activations: str = "float"

    @classmethod
    def resolve(cls, kernels: str = "auto", int4_activations: str = "float") -> KernelPolicy:
        """`kernels` (KERNELS): loads the C++ build it names, once per process (kernels/cpu_extension.py)."""
        from pagoda.kernels.cpu_extension import load  # imports torch: the CLI reads the names first

        check_kernels(kernels, int4_activations)
        if kernels == "torch":
            return cls(cpp=False, int4_activations=int4_activations)
        if kernels == "auto":
            return cls(cpp=load(), int4_activations=int4_activations)
        if not load(kernels):  # asked for by name: a silent torch fallback would hide that it never ran
            raise RuntimeError(f"kernels={kernels!r}: the C++ kernels' {kernels} build did not load (see the warning "
                               "above)")
        return cls(cpp=True, int4_activations=int4_activations)

    @property
    def kernel_set(self) -> str:
        """Which kernels run, in a word or two: what the start-up log line and /version say."""
        if not self.cpp:
            return "torch fallback"
        from pagoda.kernels.cpu_extension import build_isa

        return build_isa().name


TORCH_ONLY = KernelPolicy(cpp=False)


def check_kernels(kernels: str, int4_activations: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if int4_activations not in INT4_ACTIVATIONS:
        raise ValueError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}, got {int4_activations!r}")
