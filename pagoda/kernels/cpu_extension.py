"""Build and load Pagoda's C++ CPU kernels (pagoda/kernels/cpu/*.cpp) once per process, cached on disk.

The library registers ops under torch.ops.pagoda.*. It compiles for one target of BUILDS: `native`
(-march=native: the AVX-512, BF16 and VNNI paths where the CPU has them) or `avx2` (-march=x86-64-v3: AVX2, FMA
and F16C, no AVX-512: what CPUs without AVX-512 run, and what CI runs on an AVX-512 machine). `best_build` is
auto's pick from the CPU's features. Both builds register the same ops, so a process holds one: the first load
decides, and asking for the other one later raises. Which vector paths the loaded build has is `build_isa()`,
asked of the build itself, never of the CPU. It compiles lazily on first use with torch.utils.cpp_extension
and is reused by every later process (keyed by source, torch version, flags and, for native, the CPU). When
it cannot be built, callers use torch fallbacks; whether a model may use it at all is config's `kernels`
(kernels/policy.py).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.kernels import cpu_features

logger = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "cpu"
_SOURCES = sorted(_SRC_DIR.glob("*.cpp"))
_HEADERS = sorted(_SRC_DIR.glob("*.h"))  # part of the build hash, not compiled alone
_EXT_NAME = "pagoda_cpu_kernels"
# The target of each build. x86-64-v3 is AVX2 + FMA + F16C (+ BMI1/2, LZCNT, MOVBE): every x86 CPU since
# Haswell / Zen 1, and the ISA torch's own CPU_CAPABILITY=AVX2 kernels are built for.
BUILDS: dict[str, str] = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is only active
# when this translation unit is compiled with OpenMP. The .so then needs libgomp.so.1,
# which resolves to the copy torch already loaded (same soname): one thread pool.
_CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]


def cflags(build: str) -> list[str]:
    """The compiler flags of one of BUILDS."""
    return [BUILDS[build], *_CFLAGS]


def best_build() -> str:
    """auto's build for this CPU: native where it has AVX-512 (its BF16/VNNI paths come with it), avx2 on
    x86-64-v3 CPUs without AVX-512 (the build CI tests), native elsewhere (the portable vector code for Arm)."""
    if cpu_features.has_avx512() or not cpu_features.has_x86_64_v3():
        return "native"
    return "avx2"


@dataclass(frozen=True)
class BuildIsa:
    """The instruction sets the loaded build was compiled for (torch.ops.pagoda.build_isa, named as in
    /proc/cpuinfo). They decide its vector paths: the avx2 build on an AVX-512 CPU has none of the AVX-512 ones."""

    features: frozenset[str] = field(default_factory=frozenset)

    @functools.cached_property  # asked per op call by the fused ops
    def avx512(self) -> bool:
        """AVX-512 F and BW: the fp32 packed/streaming linears, the quantized linears, vectorized fused ops."""
        return {"avx512f", "avx512bw"} <= self.features

    @functools.cached_property
    def avx512_bf16(self) -> bool:
        """bf16 dot products: the bf16 linears, K-word attention, the quantized panel kernel."""
        return self.avx512 and "avx512_bf16" in self.features

    @property
    def name(self) -> str:
        """The kernel set in a word: what the start-up log line and /version say."""
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        if {"avx2", "fma", "f16c"} <= self.features:
            return "avx2"
        return "neon" if "asimd" in self.features else "portable C++ (no vector ISA)"


@dataclass
class _Loaded:
    build: str | None = None  # the build this process tried (BUILDS), None before the first load
    ok: bool = False
    isa: BuildIsa = field(default_factory=BuildIsa)


_lock = threading.Lock()
_loaded = _Loaded()


def build_directory(src_dir: Path = _SRC_DIR, build: str = "native") -> Path:
    """Per source/torch/flags (and, for native, CPU) build dir, so every process reuses one compiled library.

    Named <content hash>-<source path hash>: torch's build.ninja records the sources' absolute paths, so
    two checkouts with the same sources sharing one dir would each see the other's build as stale and
    recompile it; one dir per checkout keeps each build."""
    h = hashlib.sha256()
    for src in (*sorted(src_dir.glob("*.cpp")), *sorted(src_dir.glob("*.h"))):
        h.update(src.read_bytes())
    # -march=native builds are CPU specific: a shared home folder must not reuse another CPU's build.
    cpu = cpu_features.fingerprint() if build == "native" else ""
    for part in (torch.__version__, " ".join(cflags(build)), " ".join(_LDFLAGS), cpu):
        h.update(part.encode())
    where = hashlib.sha256(str(src_dir.resolve()).encode()).hexdigest()[:8]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagoda" / "torch_extensions"
    return root / f"{h.hexdigest()[:16]}-{where}"


def load(build: str | None = None) -> bool:
    """Compile (or reuse) `build` (one of BUILDS; None: the one this process loaded, else best_build()) and
    register torch.ops.pagoda.*; True on success. Raises when another build was loaded in this process, or
    where the CPU cannot run the one asked for."""
    if _loaded.build is not None and (build is None or build == _loaded.build):  # hot path: no lock once decided
        return _loaded.ok
    with _lock:
        if _loaded.build is not None:
            if build is None or build == _loaded.build:
                return _loaded.ok
            raise RuntimeError(f"kernels={build!r}: this process already loaded the C++ kernels' {_loaded.build!r} "
                               "build, and both register torch.ops.pagoda.*: choose the kernels before the first "
                               "engine starts, or run the other build in another process")
        build = build or best_build()
        if build not in BUILDS:
            raise ValueError(f"unknown kernel build {build!r}; one of {', '.join(BUILDS)}")
        if build == "avx2" and not cpu_features.has_x86_64_v3():
            raise ValueError("kernels='avx2' needs an x86-64 CPU with AVX2, FMA and F16C")
        ok, isa = _compile_and_load(build)
        _loaded.ok, _loaded.isa = ok, isa
        _loaded.build = build  # only now, so the lock-free check never sees a half-done build
        return ok


def _compile_and_load(build: str) -> tuple[bool, BuildIsa]:
    try:
        from torch.utils import cpp_extension

        build_dir = build_directory(build=build)
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        # The dir is keyed by content and path, so a missing library means ninja compiles now: say so,
        # or the first run looks hung for a minute.
        compiling = not (build_dir / f"{_EXT_NAME}.so").exists()
        if compiling:
            print(f"pagoda: compiling the CPU kernels' {build} build (once, ~1 min)...", file=sys.stderr, flush=True)
        # torch's file baton in build_dir serializes concurrent builds; a later
        # process finds ninja up to date and only loads the .so.
        cpp_extension.load(
            name=_EXT_NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=cflags(build),
            extra_ldflags=_LDFLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        if compiling:
            print(f"pagoda: CPU kernels compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        logger.debug("pagoda C++ kernels (%s build) ready in %.1fs (%s)", build, time.perf_counter() - t0, build_dir)
        if not (hasattr(torch.ops.pagoda, "paged_attention") and hasattr(torch.ops.pagoda, "rms_norm")):
            return False, BuildIsa()
        return True, BuildIsa(frozenset(torch.ops.pagoda.build_isa().split()))
    except Exception as e:  # any build/load failure means: use the torch fallback
        logger.warning("pagoda C++ kernels (%s build) unavailable (%s: %s); using the pure-torch fallback",
                       build, type(e).__name__, e)
        return False, BuildIsa()


def kernel_available() -> bool:
    """True when the C++ kernels are compiled and loaded (triggers the lazy build of best_build() once)."""
    return load()


def build_isa() -> BuildIsa:
    """The instruction sets of the loaded build (none where none loaded): what its vector paths need."""
    load()
    return _loaded.isa


def loaded_build() -> str | None:
    """The build this process loaded (BUILDS), or None where none is loaded."""
    return _loaded.build if _loaded.ok else None
