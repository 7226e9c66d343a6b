"""`pagoda kernels build`: make the C++ CPU kernels ready by hand (what `pip install` does ahead of time), and
`pagoda kernels status`: which library each build loads."""
from __future__ import annotations

import argparse
import subprocess
import sys

from pagoda.kernels.build_spec import BUILDS, builds_for_this_cpu

# One build per process: both register torch.ops.pagoda.*.
_LOAD_ONE = ("import sys; from pagoda.kernels import cpu_extension as c; c.load(sys.argv[1]); "
             "print(f'{sys.argv[1]}: {c.build_isa().name} kernels, {c.loaded_library()}')")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("build", "status"),
                   help="build: compile every build this CPU runs whose installed library is missing or stale "
                        "(into the user cache); status: say which library each build loads, compiling nothing")
    p.add_argument("--builds", default=None,
                   help=f"comma-separated builds ({', '.join(BUILDS)}); default: those this CPU runs")


def main(args: argparse.Namespace) -> int:
    builds = args.builds.split(",") if args.builds else builds_for_this_cpu()
    unknown = [b for b in builds if b not in BUILDS]
    if unknown:
        raise ValueError(f"--builds: unknown build(s) {', '.join(unknown)}; one or more of {', '.join(BUILDS)}")
    if args.action == "status":
        from pagoda.kernels.cpu_extension import BUILT_MARKER, build_directory, prebuilt_library

        for b in builds:
            lib = prebuilt_library(b)
            cached = build_directory(build=b) / BUILT_MARKER
            where = f"installed {lib}" if lib else f"compiled {cached.parent}" if cached.exists() else "not built"
            print(f"{b}: {where}")
        return 0
    failed = 0
    for b in builds:
        failed += subprocess.run([sys.executable, "-c", _LOAD_ONE, b]).returncode != 0
    return 1 if failed else 0
