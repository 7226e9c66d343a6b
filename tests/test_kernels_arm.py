"""The C++ kernels compile for Arm (aarch64 with NEON, dot products, BF16 and I8MM: Graviton 3, Ampere, Apple
silicon under Linux): every source through the aarch64 cross compiler that scripts/install.sh installs, with the
flags and torch headers of the real build. The x86 paths are behind their ISA's macros, so what compiles here is
the portable code the x86 tests also run where their vector paths don't apply."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from pagoda.kernels import cpu_extension

CXX = "aarch64-linux-gnu-g++"
SOURCES = sorted((Path(cpu_extension.__file__).parent / "cpu").glob("*.cpp"))


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} not installed (scripts/install.sh installs it)")
@pytest.mark.parametrize("march", [pytest.param("armv8-a", marks=pytest.mark.slow), "armv8.6-a+bf16+i8mm+dotprod+fp16"])
def test_every_kernel_source_compiles_for_aarch64(march: str) -> None:
    flags = ["-std=c++20", "-fsyntax-only", f"-march={march}", *cpu_extension.cflags("native")[1:],
             "-DTORCH_EXTENSION_NAME=pagoda_cpu_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    includes = [f"-isystem{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]

    def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
        return src, subprocess.run([CXX, *flags, *includes, str(src)], capture_output=True, text=True)

    with ThreadPoolExecutor(2) as pool:
        failed = [(src.name, r.stderr[-2000:]) for src, r in pool.map(compile_one, SOURCES) if r.returncode]
    assert not failed, failed
    assert len(SOURCES) >= 10
