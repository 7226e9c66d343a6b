"""The cores this process may use, and how many compute threads to run on them.

A machine's core count is the wrong default: a container limited by a CPU quota (`docker --cpus 2`, a
Kubernetes limit) or a process bound to some cores (taskset, numactl) that starts one thread per machine core
has its threads take turns on the few it has, and every parallel region waits for the slowest of them. So
threads follow the cores in this process's affinity mask, capped by the cgroup's CPU quota, unless the user
names them (`--threads`, `--cpus`, OMP_NUM_THREADS). Torch-free: read before torch starts its pool.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
logger = logging.getLogger(__name__)


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


def _busy_ticks(stat: str, cores: list[int]) -> int:
    """Clock ticks the given cores spent running anything (user, nice, system, irq, softirq, steal), from the
    text of /proc/stat."""
    want = {f"cpu{c}" for c in cores}
    total = 0
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] in want:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
            total += user + nice + system + irq + softirq + steal
    return total


class ThreadGovernor:
    """Compute threads that follow the cores other processes leave free.

    An OpenMP parallel region waits for its slowest thread, and a thread whose core another process also runs gets
    half of that core's time: a step then runs at the speed of that half, slower than on the free cores alone. So
    while other processes keep some of this process's cores busy, it runs that many fewer threads: every `interval`
    seconds it reads the cores' busy time (/proc/stat) less its own CPU time, the other processes' share in cores,
    and sets max_threads less that share (rounded half up), at least one thread: fewer threads after two readings
    that agree (a moment's load costs nothing), more at the first reading that allows them (a thread short costs
    speed every step). A reading over a gap without steps (an idle engine) only starts a new window.
    A result never depends on the thread count (the kernels split rows and output columns across threads, never a
    sum), so this changes speed only. `set_threads` is torch.set_num_threads (this module stays torch-free).
    """

    def __init__(self, cores: list[int], max_threads: int, set_threads: Callable[[int], None],
                 interval: float = 0.5, stat_path: Path = Path("/proc/stat"),
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = lambda: sum(os.times()[:2])) -> None:
        self.cores, self.max_threads, self.threads = cores, max_threads, max_threads
        self._set, self._interval, self._stat_path = set_threads, interval, stat_path
        self._clock, self._own_cpu = clock, own_cpu
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, int, float] | None = None
        self._pending: int | None = None  # a new thread count one reading has asked for
        self.others = 0.0  # cores' worth of other processes' work on these cores at the last reading

    @classmethod
    def for_this_process(cls, threads: int, set_threads: Callable[[int], None]) -> ThreadGovernor | None:
        """A governor where this process runs one thread on each core of its affinity mask (neither a CPU quota nor
        the user chose fewer) and Linux's /proc/stat is readable; None otherwise."""
        cores = affinity()
        if threads != len(cores) or threads < 2 or not Path("/proc/stat").is_file():
            return None
        return cls(cores, threads, set_threads)

    def tick(self) -> None:
        """Called once per engine step; reads the counters at most every `interval` seconds."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._interval:
            return
        try:
            busy = _busy_ticks(self._stat_path.read_text(), self.cores)
        except OSError:
            return
        mine = self._own_cpu()
        last, self._last = self._last, (now, busy, mine)
        if last is None or now - last[0] > 4 * self._interval:
            return
        wall = now - last[0]
        self.others = max(0.0, ((busy - last[1]) / self._hz - (mine - last[2])) / wall)
        want = max(1, min(self.max_threads, self.max_threads - math.floor(self.others + 0.5)))
        if want == self.threads:
            self._pending = None
        elif want > self.threads or want == self._pending:
            logger.info("compute threads: %d -> %d (other processes keep %.1f of cores %s busy)", self.threads, want,
                        self.others, ",".join(map(str, self.cores)))
            self.threads, self._pending = want, None
            self._set(want)
        else:
            self._pending = want
