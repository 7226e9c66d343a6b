"""llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`) on a float GGUF: the presets gguf-py
cannot make (the K-quants of Q4_K_M and its kin, IQ4_XS).

llama-cpp-python is run as a subprocess, in whichever python imports it: this one, or the venv that
`bash scripts/install-peers.sh llama` makes (its own build of llama.cpp, kept apart from Pagoda's).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from pagoda.bench.llama_cpp_peer import DEFAULT_LLAMA_PYTHON, INSTALL_HINT
from pagoda.cpus import affinity

# llama.cpp's presets that need no importance matrix (llama.h's LLAMA_FTYPE_MOSTLY_<name>); the number is looked
# up by name in the llama_cpp module that runs them, so it never goes stale here.
PRESETS = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS",
           "MXFP4_MOE", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


class QuantizerUnavailable(RuntimeError):
    """No python that imports llama_cpp was found."""


def quantizer_python(python: str | None = None) -> str:
    """The python to run llama.cpp's quantizer in: `python` if given, else this one where it imports llama_cpp,
    else the peer venv's; QuantizerUnavailable where none is there."""
    if python is None and importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    python = python or DEFAULT_LLAMA_PYTHON
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise QuantizerUnavailable(f"llama.cpp's quantizer not found ({python}); {INSTALL_HINT}")
    return python


def llama_quantize(src: str, dst: str, preset: str, python: str | None = None, threads: int | None = None) -> None:
    """Write `dst`, the float GGUF `src` quantized by llama.cpp to `preset` (one of PRESETS)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown llama.cpp preset {preset!r} (known: {', '.join(PRESETS)})")
    nthread = threads or len(affinity())
    proc = subprocess.run([quantizer_python(python), "-c", _QUANTIZE, src, dst, preset, str(nthread)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed making {preset} (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
