"""Which kernels a model's layers may use: decided once from config when the engine starts, handed to
`model.prepare(policy)`, never read again from anywhere else."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.kernels.tuning import KernelTuner

# auto: the C++ kernels' best build for this CPU (or the one this process already loaded), an error where it
# cannot build (never a silent torch fallback);
# native / avx2: that build of the kernels (cpu_extension.BUILDS), an error where it cannot run; torch: torch only.
KERNELS = ("auto", "native", "avx2", "torch")
QUANT_ACTIVATIONS = ("float", "int8")
# auto: where several kernels can serve a layer's shape, the one timed fastest on this machine (kernels/tuning.py,
# cached beside the build); off: the built-in choice (panels first).
KERNEL_TUNING = ("auto", "off")


@dataclass(frozen=True)
class KernelPolicy:
    cpp: bool                      # Pagoda's C++ CPU kernels (they built and config allows them)
    # "int8": INT4 and GGUF-block layers round their activations to INT8 per block and use integer dot products
    # (kernel_layout, kernels/quant_linear.py); "float": quantized weights stay weight-only.
    quant_activations: str = "float"
    # Chooses among the kernels that can serve a layer's shape (kernel_tuning="auto"); None: the built-in choice.
    tuner: KernelTuner | None = field(default=None, compare=False)

    @classmethod
    def resolve(cls, kernels: str = "auto", quant_activations: str = "float",
                kernel_tuning: str = "off") -> KernelPolicy:
        """`kernels` (KERNELS): loads the C++ build it names, once per process (kernels/cpu_extension.py).
        `kernel_tuning` (KERNEL_TUNING): the engine passes config's (default auto); "off" here keeps a bare call
        on the built-in choice, without timing anything or touching the cache file."""
        from pagoda.kernels.cpu_extension import load  # imports torch: the CLI reads the names first

        check_kernels(kernels, quant_activations, kernel_tuning)
        if kernels == "torch":
            return cls(cpp=False, quant_activations=quant_activations)
        load(None if kernels == "auto" else kernels)  # raises where it cannot: never a silent torch fallback
        tuner = None
        if kernel_tuning == "auto":
            from pagoda.kernels.tuning import cache_path, shared_tuner

            tuner = shared_tuner(cache_path())
        return cls(cpp=True, quant_activations=quant_activations, tuner=tuner)

    @property
    def kernel_set(self) -> str:
        """Which kernels run, in a word or two: what the start-up log line and /version say."""
        if not self.cpp:
            return "torch fallback"
        from pagoda.kernels.cpu_extension import build_isa

        return build_isa().name

    @property
    def kernel_build(self) -> str:
        """Which build of the C++ kernels runs and where its library came from: what /version says."""
        if not self.cpp:
            return "none"
        from pagoda.kernels.cpu_extension import PREBUILT_DIR, loaded_build, loaded_library

        library = loaded_library()
        origin = "installed" if library is not None and library.parent == PREBUILT_DIR else "compiled on first use"
        return f"{loaded_build()} ({origin})"


TORCH_ONLY = KernelPolicy(cpp=False)


def check_kernels(kernels: str, quant_activations: str, kernel_tuning: str = "off") -> None:
    if kernel_tuning not in KERNEL_TUNING:
        raise ValueError(f"kernel_tuning must be one of {', '.join(KERNEL_TUNING)}, got {kernel_tuning!r}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if quant_activations not in QUANT_ACTIVATIONS:
        raise ValueError(f"quant_activations must be one of {', '.join(QUANT_ACTIVATIONS)}, got {quant_activations!r}")
