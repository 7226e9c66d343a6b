"""Settings of the libraries under torch that are read once, when they start, and so must be in the environment
before torch runs anything: applied when `pagoda` is imported, each only where the user has not set it."""
from __future__ import annotations

import os

DEFAULTS = {
    # oneDNN's AMX kernels (torch's bf16 and int8 matmuls on AMX CPUs) change their summation order with the row
    # count, so a request's logprobs would depend on what else is in its batch. oneDNN reads its ISA cap at its
    # first primitive.
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    # libgomp's threads spin at a barrier for GOMP_SPINCOUNT rounds before they sleep (300,000 by default). On a
    # core another process also runs, a spinning thread and the thread it waits for share the core's time
    # slices, and every parallel region waits for them. A short spin still bridges the gaps between one step's
    # kernels on a quiet machine (docs/benchmarks.md, "Shared cores"). libgomp reads it when torch loads it.
    "GOMP_SPINCOUNT": "3000",
}


def apply_defaults() -> None:
    """Put DEFAULTS in the environment where they are not set (a user's own value wins)."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
