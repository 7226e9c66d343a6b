"""The C++ kernels compile for Arm (aarch64 with NEON, dot products, BF16 and I8MM: Graviton 3, Ampere, Apple
silicon under Linux): every source through the aarch64 cross compiler that scripts/install.sh installs, with the
flags and torch headers of the real build. The x86 paths are behind their ISA's macros, so what compiles here is
the portable code the x86 tests also run where their vector paths don't apply. The few ISA-specific steps of that
portable code (simd.h's FMA, widening loads, bf16 conversions, exp and horizontal sum; quant_decode.h) and the INT4 x
INT8-activation kernel (int4x8_i8.h, sdot) run under qemu against their definition, lane by lane
(tests/simd/simd_check.cpp), as they do natively on x86."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from pagoda.kernels import cpu_extension, cpu_features

CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
KERNELS = Path(cpu_extension.__file__).parent / "cpu"
SOURCES = sorted(KERNELS.glob("*.cpp"))
SIMD_CHECK = Path(__file__).parent / "simd" / "simd_check.cpp"
CHECKS = 28  # simd_check's lines: 3 formats x 6 steps, the transpose, bf16 store, bf16 load and round, vexp, fp16,
#              5 GGUF block decoders
I8_CHECKS = 3  # and the INT4 x INT8-activation kernel at 3 row counts, where the target has it (x86, Arm dotprod)


@pytest.mark.skipif(shutil.which(CXX) is None, reason=f"{CXX} not installed (scripts/install.sh installs it)")
@pytest.mark.parametrize("march", [pytest.param("armv8-a", marks=pytest.mark.slow),
                                   pytest.param("armv8.6-a+bf16+i8mm+dotprod+fp16", marks=pytest.mark.long)])
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


def _run_simd_check(cxx: str, march: str, tmp_path: Path, runner: list[str]) -> str:
    exe = tmp_path / f"simd_check_{march.replace('+', '_')}"
    build = subprocess.run([cxx, "-O2", "-std=c++20", f"-march={march}", f"-I{KERNELS}", str(SIMD_CHECK), "-o",
                            str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "FAIL" not in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(shutil.which(CXX) is None or shutil.which(QEMU) is None,
                    reason=f"{CXX} or {QEMU} not installed (scripts/install.sh installs them)")
def test_neon_steps_compute_their_definition_under_qemu(tmp_path: Path) -> None:
    out = _run_simd_check(CXX, "armv8-a", tmp_path, [QEMU, "-L", "/usr/aarch64-linux-gnu"])
    assert out.startswith("W=4\n") and out.count("ok ") == CHECKS  # NEON: one q register; no sdot
    out = _run_simd_check(CXX, "armv8.2-a+dotprod", tmp_path, [QEMU, "-L", "/usr/aarch64-linux-gnu"])
    assert out.count("ok ") == CHECKS + I8_CHECKS and "ok int4x8 int8-activation kernel, 6 rows" in out


@pytest.mark.parametrize("march,lanes", [("x86-64-v3", 8), ("native", 16)])
def test_x86_steps_compute_their_definition(tmp_path: Path, march: str, lanes: int) -> None:
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    if march == "native" and not cpu_features.has_avx512():
        pytest.skip("the AVX-512 lanes need an AVX-512 CPU")
    if march == "x86-64-v3" and not cpu_features.has_x86_64_v3():
        pytest.skip("needs an x86-64-v3 CPU")
    out = _run_simd_check("g++", march, tmp_path, [])
    assert out.startswith(f"W={lanes}\n") and out.count("ok ") == CHECKS + I8_CHECKS
