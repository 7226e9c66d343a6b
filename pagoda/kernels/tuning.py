"""Kernel auto-tuning: where several kernels can serve one linear layer, time them once on this machine and keep
the choice in a file beside the kernel build (config `kernel_tuning="auto"`).

The choice is per layer shape, never per row count: a layer runs one kernel at every row count (batch invariance,
kernels/linear.py), so every candidate here serves every row count and the tuner picks the one whose times over a
few row counts are best. Shapes repeat across a model's layers (dozens of layers, a handful of shapes); each is measured
once: per process (entries in memory) and per machine (the cache file, keyed by the thread count too).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from pagoda import paths

logger = logging.getLogger(__name__)

_VERSION = 1  # of the file's layout: a file of another version is ignored and rewritten

# Row counts timed: 1 (batch-1 decode: the weight is streamed once for one row), 8 (a decode batch: one register
# tile of the panel kernels) and 64 (a prefill chunk: where a GEMM's compute, not the weight read, dominates).
# Together they cover the regimes in which the candidates differ, at ~3 calls' cost per candidate.
ROWS = (1, 8, 64)
# A challenger must beat the built-in choice by this much to replace it: timings on a busy machine wobble by a
# few percent, and the built-in dense choice (panels) also lets the C++ decoder stack run, which a layer timing
# does not see.
MARGIN = 0.05
# Each shape is timed in two passes, which must agree on the choice for it to be cached. Per pass and row count,
# the repetitions of all candidates together take about _POINT_BUDGET_S (at least _MIN_REPS each), so a layer
# shape costs tens of milliseconds at most, once.
_PASSES = 2
_POINT_BUDGET_S = 2e-3
_MIN_REPS, _MAX_REPS = 2, 5
# A pass counts only if the thread that times it ran through it: its CPU time over the pass must reach this share
# of the wall time (it computes its part of each region or spins at the barrier). Right after a model loads, the
# scheduler can wake the long-idle OpenMP workers onto the loading thread's core, and until its balancer spreads
# them the timing thread gets part of its core: every region runs slower, small layers the most, and their times
# can rank the kernels backwards (docs/benchmarks.md, "kernel tuning after a load"). Another process on the cores
# does the same. A pass that falls short is measured again, up to _ATTEMPTS times.
_MIN_CPU_SHARE = 0.85
_ATTEMPTS = 6


class Runs(Protocol):
    """A candidate kernel: what the tuner needs of a LinearKernel (x [M, K] -> [M, N])."""

    @property
    def run(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


K = TypeVar("K", bound=Runs)


@dataclass(frozen=True)
class TuningShape:
    """What a layer's timing depends on, besides the candidates and the thread count."""

    format: str          # the weight's format: "bfloat16", "float32" (dense) or "int4", "int4+off", "int8", "fp8"
    n: int               # output features
    k: int               # input features
    group_size: int      # quantization group (0: dense)
    act_dtype: torch.dtype

    def key(self, names: tuple[str, ...], threads: int) -> str:
        act = str(self.act_dtype).removeprefix("torch.")
        return f"{self.format} {self.n}x{self.k} g{self.group_size} act={act} threads={threads} {'|'.join(names)}"


@dataclass
class TuningEntry:
    """One shape's measurement: per candidate its best time (s) at each of `rows`, its score, and the choice."""

    rows: list[int]
    times: dict[str, list[float]]
    scores: dict[str, float]
    chosen: str
    key: str = ""  # filled from the file's key on load

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "key"}

    @staticmethod
    def from_json(key: str, d: Any) -> TuningEntry:
        """Raises (KeyError, TypeError, ValueError) on anything that is not an entry this version wrote."""
        entry = TuningEntry([int(r) for r in d["rows"]],
                            {str(n): [float(t) for t in ts] for n, ts in d["times"].items()},
                            {str(n): float(s) for n, s in d["scores"].items()}, str(d["chosen"]), key)
        if entry.chosen not in entry.times or any(len(ts) != len(entry.rows) for ts in entry.times.values()):
            raise ValueError(f"inconsistent entry {key!r}")
        return entry


def score(times: Mapping[str, list[float]]) -> dict[str, float]:
    """Per candidate, the sum over row counts of its time relative to the best candidate's at that row count: each
    regime (decode, batch, prefill) weighs the same, where summing seconds would let 64 rows decide alone."""
    names = list(times)
    best = [min(times[n][i] for n in names) for i in range(len(times[names[0]]))]
    return {n: sum(t / max(b, 1e-12) for t, b in zip(times[n], best)) for n in names}


def pick(scores: Mapping[str, float], default: str) -> str:
    """The best-scoring candidate, unless it beats `default` (the built-in choice) by less than MARGIN."""
    best = min(scores, key=lambda n: scores[n])
    return best if scores[best] < scores[default] * (1 - MARGIN) else default


def cache_path() -> Path | None:
    """tuning.json beside the loaded kernel build (its folder is keyed by sources, flags and CPU), or the file
    PAGODA_TUNING_CACHE names; None where no build is loaded."""
    override = paths.tuning_file_override()
    if override is not None:
        return override
    from pagoda.kernels.cpu_extension import TUNING_FILE, build_directory, loaded_build

    build = loaded_build()
    return None if build is None else build_directory(build=build) / TUNING_FILE


@dataclass
class KernelTuner:
    """Chooses among a layer's candidate kernels (`choose`), from `path` (read once) or by timing them."""

    path: Path | None            # the cache file; None: measure, keep in memory only
    rows: tuple[int, ...] = ROWS
    entries: dict[str, TuningEntry] = field(default_factory=dict)
    measured: int = 0            # shapes timed by this tuner (the rest came from the file or from memory)
    _loaded: bool = field(default=False, repr=False)
    _unstable: set[str] = field(default_factory=set, repr=False)  # measured, passes disagreed: not written
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def choose(self, shape: TuningShape, candidates: Mapping[str, Callable[[], K]]) -> tuple[K, TuningEntry]:
        """The kernel for `shape` among `candidates` (name -> builder, the built-in choice first; only the chosen
        one is built when the choice is known) and the entry that chose it."""
        names = tuple(candidates)
        key = shape.key(names, torch.get_num_threads())
        with self._lock:
            self._load()
            entry = self.entries.get(key)
            if entry is not None and entry.chosen in candidates:
                return candidates[entry.chosen](), entry
            kernels = {name: build() for name, build in candidates.items()}
            t0 = time.perf_counter()
            passes, ran = self._passes(kernels, shape)
            times = {name: [min(ts) for ts in zip(*(p[name] for p in passes))] for name in names}
            scores = score(times)
            choices = {pick(score(p), names[0]) for p in passes}
            # Passes that disagree or that the timing thread never ran through, or a machine with more runnable threads
            # than cores: another process on the cores stalls the kernels' threads at random, and the times say
            # little. Keep the built-in choice for this process and leave the shape to be measured next time.
            stable = len(choices) == 1 and ran and not machine_busy()
            entry = TuningEntry(list(self.rows), times, scores, pick(scores, names[0]) if stable else names[0], key)
            self.entries[key] = entry
            self.measured += 1
            logger.debug("kernel tuning: %s -> %s (%.0f ms%s)", key, entry.chosen, 1e3 * (time.perf_counter() - t0),
                         "" if stable else ", unstable: not cached")
            if stable:
                self._save()
            else:
                self._unstable.add(key)
            return kernels[entry.chosen], entry

    def _passes(self, kernels: Mapping[str, Runs], shape: TuningShape) -> tuple[list[dict[str, list[float]]], bool]:
        """_PASSES measurements that the timing thread ran through (a pass it did not is measured again, up to
        _ATTEMPTS in all), and whether there were that many; else the last ones measured."""
        tried: list[dict[str, list[float]]] = []
        good: list[dict[str, list[float]]] = []
        for _ in range(_ATTEMPTS):
            wall, cpu = time.perf_counter(), time.thread_time()
            tried.append(self.measure(kernels, shape.k, shape.act_dtype))
            if ran_through(time.thread_time() - cpu, time.perf_counter() - wall):
                good.append(tried[-1])
                if len(good) == _PASSES:
                    return good, True
        return tried[-_PASSES:], False

    def measure(self, kernels: Mapping[str, Runs], k: int, dtype: torch.dtype) -> dict[str, list[float]]:
        """Per candidate, its best time (s) at each of `rows`: warmed up once, then min over repetitions that
        alternate between candidates (so a slow spell of the machine hits all of them alike)."""
        x = torch.randn(max(self.rows), k, generator=torch.Generator().manual_seed(0)).to(dtype)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for m in self.rows:
            xm = x[:m]
            t0 = time.perf_counter()
            for kernel in kernels.values():  # first call: allocations, the weight into cache
                kernel.run(xm)
            warm = time.perf_counter() - t0
            reps = max(_MIN_REPS, min(_MAX_REPS, int(_POINT_BUDGET_S / max(warm, 1e-9))))
            best = dict.fromkeys(kernels, math.inf)
            for _ in range(reps):
                for name, kernel in kernels.items():
                    t = time.perf_counter()
                    kernel.run(xm)
                    best[name] = min(best[name], time.perf_counter() - t)
            for name in kernels:
                times[name].append(round(best[name], 9))
        return times

    def _load(self) -> None:
        """Read the file once; entries measured in this process win over the file's."""
        if self._loaded:
            return
        self._loaded = True
        for key, entry in self._read().items():
            self.entries.setdefault(key, entry)

    def _read(self, warn: bool = True) -> dict[str, TuningEntry]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("version") != _VERSION:
                raise ValueError(f"version {data.get('version')!r}, not {_VERSION}")
            return {key: TuningEntry.from_json(key, d) for key, d in data["entries"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if warn:
                logger.warning("kernel tuning: ignoring %s (%s: %s); it is measured again and rewritten",
                               self.path, type(e).__name__, e)
            return {}

    def _save(self) -> None:
        """Write every entry, merged over what the file holds now (another process may have added some), to a
        temporary file replaced atomically: a reader sees the old file or the new one, never half of one."""
        if self.path is None:
            return
        ours = {key: e for key, e in self.entries.items() if key not in self._unstable}
        merged = {**self._read(warn=False), **ours}
        # One entry a line: a file a person can read and diff.
        lines = ",\n".join(f"  {json.dumps(key)}: {json.dumps(e.to_json())}" for key, e in sorted(merged.items()))
        text = f'{{"version": {_VERSION}, "entries": {{\n{lines}\n}}}}\n'
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # a read-only cache: the choices still hold for this process
            logger.warning("kernel tuning: cannot write %s (%s)", self.path, e)


def ran_through(cpu_s: float, wall_s: float) -> bool:
    """Whether the timing thread ran for most of a measurement that took `wall_s`, `cpu_s` of its CPU time (a moment
    too short to judge counts as yes)."""
    return wall_s < 1e-3 or cpu_s >= _MIN_CPU_SHARE * wall_s


def machine_busy() -> bool:
    """Whether the machine ran more threads than it has cores over the last minute (other work than ours)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


_shared: dict[Path | None, KernelTuner] = {}
_shared_lock = threading.Lock()


def shared_tuner(path: Path | None) -> KernelTuner:
    """One tuner per cache file in a process: every engine's models share its entries, and the file is read once."""
    with _shared_lock:
        if path not in _shared:
            _shared[path] = KernelTuner(path)
        return _shared[path]
