"""Compiles the C++ CPU kernels ahead of time, as part of building the package (`pip install`, a wheel).

Every build this CPU runs (kernels/build_spec.py: native, and avx2 on x86-64-v3) becomes one library under
pagoda/kernels/prebuilt/, named by its key, so the first `pagoda generate` loads it instead of compiling.
PAGODA_KERNEL_BUILDS chooses the builds (a comma-separated list of native and avx2, or `none`). The rest of the
package's metadata is pyproject.toml's.
"""
import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # pagoda.kernels.build_spec and cpu_features import neither torch nor the package


def kernel_extensions() -> tuple[list, dict]:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    from pagoda.kernels import build_spec

    wanted = os.environ.get("PAGODA_KERNEL_BUILDS", "").strip()
    builds = build_spec.builds_for_this_cpu() if not wanted else [b for b in wanted.split(",") if b != "none"]
    unknown = set(builds) - set(build_spec.BUILDS)
    if unknown:
        raise SystemExit(f"PAGODA_KERNEL_BUILDS: unknown build(s) {sorted(unknown)}; "
                         f"one or more of {', '.join(build_spec.BUILDS)}, or none")
    srcs = [str(s.relative_to(HERE)) for s in build_spec.sources()]
    exts = []
    for b in builds:
        name = build_spec.prebuilt_name(b, build_spec.build_key(b, torch.__version__))
        exts.append(CppExtension(f"{build_spec.PREBUILT_PACKAGE}.{name}", srcs,
                                 extra_compile_args={"cxx": build_spec.cflags(b)},
                                 extra_link_args=list(build_spec.LDFLAGS)))

    class BuildEachTargetApart(BuildExtension):
        """Every build compiles the same sources with other flags: each gets its own object folder, so none
        links another's objects."""

        def build_extension(self, ext):  # noqa: ANN001, ANN202 - setuptools' signature
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    return exts, {"build_ext": BuildEachTargetApart}


ext_modules, cmdclass = kernel_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
