"""Busy processes beside a benchmark: a machine shared with a database, a tokenizer or a browser, as servers and
laptops are. Each spins on one core of this process's affinity (the last ones), so a run measures what Pagoda
keeps of its speed when that core is taken."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True: pass"


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
    """Run `n` busy-spinning processes, one pinned to each of the last `n` cores this process may use, for the
    duration of the block; yields those cores."""
    cores = sorted(os.sched_getaffinity(0))
    if not 0 <= n <= len(cores):
        raise ValueError(f"--contend {n}: this process may use {len(cores)} cores")
    taken = cores[len(cores) - n:]
    procs = []
    try:
        for core in taken:
            p = subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            procs.append(p)
            os.sched_setaffinity(p.pid, {core})
        yield taken
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
