"""What this CPU can run, read once from /proc/cpuinfo: the one place kernels and config ask."""
from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` (x86) or `Features` (Arm) of /proc/cpuinfo's first processor (empty where there are none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def has_avx512() -> bool:
    """AVX-512 F and BW: the kernels' native build has its AVX-512 paths here (cpu_extension.best_build).
    What a loaded build runs is cpu_extension.build_isa(), not this."""
    return {"avx512f", "avx512bw"} <= cpu_flags()


@functools.cache
def has_avx512_bf16() -> bool:
    """AVX512-BF16's dot products (the native build's panel GEMMs and K-word attention use them)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def has_x86_64_v3() -> bool:
    """x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE): the CPU runs the kernels' avx2 build."""
    return {"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"} <= cpu_flags()


@functools.cache
def has_native_bf16() -> bool:
    """bf16 matmuls run natively (AVX512-BF16 or AMX), so bf16 is the fast compute dtype."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def fingerprint() -> str:
    """Tells one CPU model's -march=native build from another's."""
    return " ".join(sorted(cpu_flags())) or platform.processor()
