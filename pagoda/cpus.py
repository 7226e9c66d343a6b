"""The cores this process may use, and how many compute threads to run on them.

A machine's core count is the wrong default: a container limited by a CPU quota (`docker --cpus 2`, a
Kubernetes limit) or a process bound to some cores (taskset, numactl) that starts one thread per machine core
has its threads take turns on the few it has, and every parallel region waits for the slowest of them. So
threads follow the cores in this process's affinity mask, capped by the cgroup's CPU quota, unless the user
names them (`--threads`, `--cpus`, OMP_NUM_THREADS). Torch-free: read before torch starts its pool.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6,8-9' (taskset's and Linux's cpulist form) as sorted core ids; ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpus: cannot read {text!r} (use a list such as 0-3,6)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpus: the range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError("cpus: the list is empty")
    return sorted(cores)


def affinity() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """Cores' worth of CPU time the cgroup allows (quota / period), or None where there is no limit: cgroup v2's
    cpu.max ("QUOTA PERIOD" or "max PERIOD"), else v1's cpu.cfs_quota_us and cpu.cfs_period_us."""
    try:
        fields = (root / "cpu.max").read_text().split()
    except OSError:
        try:
            fields = [(root / "cpu" / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")]
        except OSError:
            return None
    if len(fields) < 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None  # "max", v1's -1, or unreadable: no limit
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def default_threads(cores: list[int], limit: float | None) -> int:
    """One thread per usable core: the affinity mask, capped by the quota (rounded up: a quota of 1.5 cores
    keeps two threads busy half the time better than one all the time)."""
    n = len(cores)
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def resolve(cpus: str | None, threads: int | None) -> tuple[list[int] | None, int | None]:
    """(the cores to bind this process to, or None to keep its mask; the compute threads to run, or None to
    leave torch's as the user set them through OMP_NUM_THREADS). ValueError for a core this process may not use."""
    allowed = affinity()
    cores = None
    if cpus is not None:
        cores = parse_cpu_list(cpus)
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise ValueError(f"cpus: core(s) {','.join(map(str, outside))} are not available to this process "
                             f"(it may run on {','.join(map(str, allowed))})")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return cores, threads
    if cores is None and os.environ.get("OMP_NUM_THREADS"):
        return None, None
    return cores, default_threads(cores or allowed, cgroup_cpu_limit())
