"""One thread or two opening OpenMP regions: `python -m benchmarks.openmp_threads`.

libgomp keeps a pool of workers for every thread that opens parallel regions; once its pools hold more threads
than there are cores, it stops spinning at barriers. This times the same work two ways in one process:
  first    on the main thread, the only one to have opened regions so far;
  second   on another thread, while the main thread's pool is alive (as when a server loaded its model on the
           main thread and stepped it on an engine thread, before AsyncEngine.launch).
Each row is a median of --reps calls: a short AMX/AVX-512 GEMM and SiLU-and-mul (C++ ops, one parallel region
each), and a 32-row bf16 decode forward of the embedded model.
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)

    from pagoda import LLM
    from pagoda.kernels.linear import panel_pack

    llm = LLM(dtype="bfloat16", max_model_len=2048, max_num_seqs=64, enable_prefix_caching=False)
    runner = llm.engine.runner
    bs = runner.block_size
    rng = random.Random(0)
    # 32 sequences at 150 tokens of context, their KV written by a prefill first (unwritten blocks read as zeros).
    per = -(-151 // bs)
    rows = [([rng.randrange(1000, 40000) for _ in range(150)], 0, list(range(i * per, (i + 1) * per)))
            for i in range(32)]
    runner.forward_rows(rows)
    decode = [([rng.randrange(1000, 40000)], 150, table) for _, _, table in rows]
    x = torch.randn(64, 576).bfloat16()
    w = panel_pack(torch.randn(3072, 576).bfloat16())
    h = torch.randn(64, 3072).bfloat16()
    work = {"GEMM 64x576x3072": lambda: torch.ops.pagoda.packed_linear(x, w, None),
            "SiLU-and-mul 64x1536": lambda: torch.ops.pagoda.silu_and_mul(h),
            "32-row decode forward": lambda: runner.forward_rows(decode)}
    results: dict[str, dict[str, float]] = {name: {} for name in work}

    def measure(label: str) -> None:
        for name, fn in work.items():
            results[name][label] = median_ms(fn, args.reps)

    measure("first")  # the main thread built the model: its pool exists
    second = threading.Thread(target=measure, args=("second",))
    second.start()
    second.join()
    print(f"{'work':24s} {'first':>9s} {'second':>9s}")
    for name, r in results.items():
        print(f"{name:24s} {r['first']:8.3f}  {r['second']:8.3f}  ms  ({r['second'] / r['first']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
