"""Load Pagoda's C++ CPU kernels (pagoda/kernels/cpu/*.cpp) once per process.

The library registers ops under torch.ops.pagoda.*. It is compiled for one target of BUILDS: `native`
(-march=native: the AVX-512, BF16 and VNNI paths where the CPU has them) or `avx2` (-march=x86-64-v3: AVX2, FMA
and F16C, no AVX-512: what CPUs without AVX-512 run, and what CI runs on an AVX-512 machine). `best_build` is
auto's pick from the CPU's features. Both builds register the same ops, so a process holds one: the first load
decides, and asking for the other one later raises. Which vector paths the loaded build has is `build_isa()`,
asked of the build itself, never of the CPU.

`pip install` compiles the builds this CPU runs ahead of time (setup.py, into pagoda/kernels/prebuilt/); a library
whose key (kernels/build_spec.py: sources, torch version, flags, CPU) matches is loaded as it is. Otherwise (a
source checkout whose kernels changed, another CPU) it is compiled here once, with torch.utils.cpp_extension, into a
user cache folder that every later process reuses. That build holds an OS lock, which the kernel releases when
its holder dies, so a build killed half-way is redone by the next process, never waited on. A build that fails is
an error naming the compiler's output: the torch-only path runs only where config asks for kernels="torch".
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda import paths
from pagoda.kernels import cpu_features
from pagoda.kernels.build_spec import (
    BUILDS,
    EXT_NAME,
    LDFLAGS,
    PREBUILT_DIR,
    SRC_DIR,
    best_build,
    build_key,
    cflags,
    prebuilt_name,
    sources,
)

logger = logging.getLogger(__name__)

__all__ = ["BUILDS", "KernelBuildError", "best_build", "build_directory", "build_isa", "cflags", "jit_build",
           "kernel_available", "load", "loaded_build", "loaded_library", "prebuilt_library"]

TUNING_FILE = "tuning.json"  # kernels/tuning.py's table, in the build's cache folder
BUILT_MARKER = "built.ok"  # written once a build in a cache folder completed: a folder without it is half-built


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message ends with the compiler's output."""


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
    error: KernelBuildError | None = None  # why it did not load (raised again on every later ask)
    isa: BuildIsa = field(default_factory=BuildIsa)
    library: Path | None = None  # the file loaded: the install's prebuilt library or a cache folder's


_lock = threading.Lock()
_loaded = _Loaded()


def build_directory(src_dir: Path = SRC_DIR, build: str = "native") -> Path:
    """The cache folder of `build` compiled from `src_dir` here (also where its tuning table lives).

    Named <key>-<source path hash>: torch's build.ninja records the sources' absolute paths, so two checkouts
    with the same sources sharing one dir would each see the other's build as stale and recompile it; one dir per
    checkout keeps each build."""
    where = hashlib.sha256(str(src_dir.resolve()).encode()).hexdigest()[:8]
    return paths.kernel_builds_dir() / f"{build_key(build, torch.__version__, src_dir)}-{where}"


def prebuilt_library(build: str, src_dir: Path = SRC_DIR) -> Path | None:
    """The library of `build` that setup.py compiled at install from these very sources, for this torch (and,
    for native, this CPU); None where there is none (a stale or foreign one does not count)."""
    name = prebuilt_name(build, build_key(build, torch.__version__, src_dir))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = PREBUILT_DIR / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def load(build: str | None = None) -> bool:
    """Load `build` (one of BUILDS; None: the one this process loaded, else best_build()), compiling it first
    where no library of its key exists, and register torch.ops.pagoda.*; True once loaded. Raises
    KernelBuildError where it cannot be built or loaded (again on every call), RuntimeError when another build
    was loaded in this process, ValueError where the CPU cannot run the one asked for."""
    if _loaded.build is not None and (build is None or build == _loaded.build):  # hot path: no lock once decided
        if _loaded.error is not None:
            raise _loaded.error
        return True
    with _lock:
        if _loaded.build is not None:
            if build is None or build == _loaded.build:
                if _loaded.error is not None:
                    raise _loaded.error
                return True
            raise RuntimeError(f"kernels={build!r}: this process already loaded the C++ kernels' {_loaded.build!r} "
                               "build, and both register torch.ops.pagoda.*: choose the kernels before the first "
                               "engine starts, or run the other build in another process")
        build = build or best_build()
        if build not in BUILDS:
            raise ValueError(f"unknown kernel build {build!r}; one of {', '.join(BUILDS)}")
        if build == "avx2" and not cpu_features.has_x86_64_v3():
            raise ValueError("kernels='avx2' needs an x86-64 CPU with AVX2, FMA and F16C")
        try:
            _loaded.library, _loaded.isa = _load_library(build)
        except KernelBuildError as e:
            _loaded.error = e
        _loaded.build = build  # only now, so the lock-free check never sees a half-done load
        if _loaded.error is not None:
            raise _loaded.error
        return True


def _load_library(build: str) -> tuple[Path, BuildIsa]:
    library = prebuilt_library(build)
    if library is None:
        library = jit_build(EXT_NAME, sources(), cflags(build), build_directory(build=build), label=f"{build} build")
    try:
        torch.ops.load_library(str(library))
        isa = BuildIsa(frozenset(torch.ops.pagoda.build_isa().split()))
    except (OSError, RuntimeError, AttributeError) as e:
        raise KernelBuildError(f"the C++ kernels' {build} build ({library}) did not load: {e}") from e
    logger.debug("pagoda C++ kernels: %s build from %s", build, library)
    return library, isa


def jit_build(name: str, srcs: list[Path], flags: list[str], build_dir: Path, label: str = "") -> Path:
    """Compile `srcs` into `build_dir`/`name`.so (once: a complete build is reused) and return its path; a compile
    also loads it into this process. One process builds a folder at a time, under an flock that dies with its
    holder; a folder that a killed build left half-done is wiped and built again."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with open(build_dir.parent / f"{build_dir.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"pagoda: waiting for another process compiling the CPU kernels' {label} ({build_dir})...",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file() and (build_dir / BUILT_MARKER).is_file():
            return library
        # No other process builds here now: whatever is in the folder is what a killed build left (torch's own
        # file baton among it, which would make cpp_extension wait forever).
        for entry in build_dir.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.name != TUNING_FILE:  # the tuning table holds for any build of this key
                entry.unlink()
        print(f"pagoda: compiling the CPU kernels' {label} (once, ~1 min)...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            # Compiles with ninja, then loads the library into this process (torch.ops.load_library).
            cpp_extension.load(name=name, sources=[str(s) for s in srcs], extra_cflags=list(flags),
                               extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), is_python_module=False,
                               is_standalone=False, verbose=False)
        except Exception as e:
            raise KernelBuildError(_build_failure(label, build_dir, e)) from None
        (build_dir / BUILT_MARKER).write_text(f"{time.time()}\n")
        print(f"pagoda: CPU kernels compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return library


def _build_failure(label: str, build_dir: Path, e: Exception) -> str:
    """The error of a failed build, ending with the tail of the compiler's output (torch's message holds it)."""
    lines = str(e).strip().splitlines()
    tail = "\n".join(lines[-40:])
    return (f"the C++ CPU kernels' {label} failed to compile in {build_dir} ({type(e).__name__}); "
            f"kernels='torch' runs without them, slower. The compiler said:\n{tail}")


def kernel_available() -> bool:
    """True once the C++ kernels are loaded (loads best_build() on the first call; raises where it cannot)."""
    return load()


def build_isa() -> BuildIsa:
    """The instruction sets of the loaded build: what its vector paths need."""
    load()
    return _loaded.isa


def loaded_library() -> Path | None:
    """The file of the loaded build: the install's prebuilt library or a cache folder's (None where none loaded)."""
    return _loaded.library if loaded_build() is not None else None


def loaded_build() -> str | None:
    """The build this process loaded (BUILDS), or None where none is loaded."""
    return _loaded.build if _loaded.build is not None and _loaded.error is None else None
