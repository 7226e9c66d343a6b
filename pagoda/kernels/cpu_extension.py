"""Build and load Pagoda's C++ CPU kernels (pagoda/kernels/cpu/*.cpp) once, cached on disk.

The library registers ops under torch.ops.pagoda.*. It compiles lazily on first use with
torch.utils.cpp_extension and is reused by every later process (keyed by source, torch version,
flags and CPU). When it cannot be built, callers use torch fallbacks; whether a model may use it at all is
config's `kernels` (kernels/policy.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from pagoda.kernels import cpu_features

logger = logging.getLogger(__name__)

_SRC_DIR = Path(__file__).parent / "cpu"
_SOURCES = sorted(_SRC_DIR.glob("*.cpp"))
_HEADERS = sorted(_SRC_DIR.glob("*.h"))  # part of the build hash, not compiled alone
_EXT_NAME = "pagoda_cpu_kernels"
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is only active
# when this translation unit is compiled with OpenMP. The .so then needs libgomp.so.1,
# which resolves to the copy torch already loaded (same soname): one thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "warned": False}


def build_directory(src_dir: Path = _SRC_DIR) -> Path:
    """Per source/torch/CPU build dir, so every process reuses one compiled library.

    Named <content hash>-<source path hash>: torch's build.ninja records the sources' absolute paths, so
    two checkouts with the same sources sharing one dir would each see the other's build as stale and
    recompile it; one dir per checkout keeps each build."""
    h = hashlib.sha256()
    for src in (*sorted(src_dir.glob("*.cpp")), *sorted(src_dir.glob("*.h"))):
        h.update(src.read_bytes())
    # -march=native builds are CPU specific: a shared home folder must not reuse another CPU's build.
    for part in (torch.__version__, " ".join(_CFLAGS), " ".join(_LDFLAGS), cpu_features.fingerprint()):
        h.update(part.encode())
    where = hashlib.sha256(str(src_dir.resolve()).encode()).hexdigest()[:8]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagoda" / "torch_extensions"
    return root / f"{h.hexdigest()[:16]}-{where}"


def _load() -> bool:
    """Compile (or reuse) the extension and register torch.ops.pagoda.*; True on success."""
    if _state["tried"]:  # hot path: no lock once decided
        return bool(_state["ok"])
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        try:
            from torch.utils import cpp_extension

            build_dir = build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            # The dir is keyed by content and path, so a missing library means ninja compiles now: say so,
            # or the first run looks hung for a minute.
            compiling = not (build_dir / f"{_EXT_NAME}.so").exists()
            if compiling:
                print("pagoda: compiling CPU kernels (once, ~1 min)...", file=sys.stderr, flush=True)
            # torch's file baton in build_dir serializes concurrent builds; a later
            # process finds ninja up to date and only loads the .so.
            cpp_extension.load(
                name=_EXT_NAME,
                sources=[str(s) for s in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            if compiling:
                print(f"pagoda: CPU kernels compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            logger.debug("pagoda C++ kernels ready in %.1fs (%s)", time.perf_counter() - t0, build_dir)
            _state["ok"] = hasattr(torch.ops.pagoda, "paged_attention") and hasattr(torch.ops.pagoda, "rms_norm")
        except Exception as e:  # any build/load failure means: use the torch fallback
            logger.warning("pagoda C++ kernels unavailable (%s: %s); using the pure-torch fallback",
                           type(e).__name__, e)
            _state["warned"] = True
            _state["ok"] = False
        _state["tried"] = True  # only now, so the lock-free check never sees a half-done build
        return bool(_state["ok"])


def kernel_available() -> bool:
    """True when the C++ kernels are compiled and loaded (triggers the lazy build once)."""
    return _load()


