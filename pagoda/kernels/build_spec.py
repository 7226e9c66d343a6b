"""What one build of Pagoda's C++ CPU kernels is: its sources, its target's flags, and the key that names the
library compiled from them.

Read by setup.py, which compiles the kernels ahead of time when the package is built (`pip install`), and by
kernels/cpu_extension.py, which loads that library where its key matches and otherwise compiles one itself; both
ask here, so they agree on what is stale. Kept free of torch (setup.py imports it before torch may be importable):
the torch version is passed in.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from pagoda.kernels import cpu_features

SRC_DIR = Path(__file__).parent / "cpu"
# Where setup.py puts the libraries it compiles: a subpackage, so a wheel and an editable install both carry them.
PREBUILT_PACKAGE = "pagoda.kernels.prebuilt"
PREBUILT_DIR = Path(__file__).parent / "prebuilt"
EXT_NAME = "pagoda_cpu_kernels"
# The target of each build. x86-64-v3 is AVX2 + FMA + F16C (+ BMI1/2, LZCNT, MOVBE): every x86 CPU since
# Haswell / Zen 1, and the ISA torch's own CPU_CAPABILITY=AVX2 kernels are built for.
BUILDS: dict[str, str] = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is only active
# when this translation unit is compiled with OpenMP. The .so then needs libgomp.so.1,
# which resolves to the copy torch already loaded (same soname): one thread pool.
# Tuples: torch's cpp_extension.load appends to the flag lists it is given, which would change the key.
CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)


def sources(src_dir: Path = SRC_DIR) -> list[Path]:
    """The translation units (the headers are part of the key, not compiled alone)."""
    return sorted(src_dir.glob("*.cpp"))


def cflags(build: str) -> list[str]:
    """The compiler flags of one of BUILDS."""
    return [BUILDS[build], *CFLAGS]


def best_build() -> str:
    """auto's build for this CPU: native where it has AVX-512 (its BF16/VNNI paths come with it), avx2 on
    x86-64-v3 CPUs without AVX-512 (the build CI tests), native elsewhere (the portable vector code for Arm)."""
    if cpu_features.has_avx512() or not cpu_features.has_x86_64_v3():
        return "native"
    return "avx2"


def builds_for_this_cpu() -> list[str]:
    """The builds this CPU runs: native, and avx2 where it differs from native and the CPU has x86-64-v3."""
    return ["native", "avx2"] if cpu_features.has_x86_64_v3() else ["native"]


def build_key(build: str, torch_version: str, src_dir: Path = SRC_DIR) -> str:
    """Names the library that `build` compiles from `src_dir`'s sources against `torch_version`: the same key, the
    same library. A -march=native build is also keyed by the CPU, so one CPU never loads another's."""
    h = hashlib.sha256()
    for src in (*sorted(src_dir.glob("*.cpp")), *sorted(src_dir.glob("*.h"))):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    cpu = cpu_features.fingerprint() if build == "native" else ""
    for part in (torch_version, " ".join(cflags(build)), " ".join(LDFLAGS), cpu):
        h.update(part.encode())
    return h.hexdigest()[:16]


def prebuilt_name(build: str, key: str) -> str:
    """The module name (under PREBUILT_PACKAGE) of `build`'s library compiled at install with `key`."""
    return f"{build}_{key}"
