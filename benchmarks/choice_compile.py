"""Compile time of `choice` lists of growing size through StructuredOutputManager (auto backend), the embedded
model's vocabulary: what structured/limits.py's MAX_ALTERNATIVES bounds.

    python benchmarks/choice_compile.py 1024 4096 16384
"""
from __future__ import annotations

import argparse
import time

from pagoda.model.default_model import default_model_path
from pagoda.model.loader import resolve_model_files
from pagoda.model.tokenizer import load_tokenizer
from pagoda.structured.manager import StructuredOutputManager
from pagoda.structured.params import StructuredOutputsParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sizes", type=int, nargs="+")
    args = p.parse_args()
    tok = load_tokenizer(resolve_model_files(default_model_path()))
    backend = StructuredOutputManager(tok, 49152).backend  # the backend itself: no limits, built first
    for n in args.sizes:
        choice = [f"item number {i}" for i in range(n)]
        t0 = time.perf_counter()
        backend.compile(StructuredOutputsParams(choice=choice))
        print(f"{n} strings: {time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
