"""How fast a decode step's linears read their weights: `python -m benchmarks.decode_linears [--rows 32 80]`.

SmolLM2-135M's four decoder linears (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) in bf16,
packed as the engine packs them (packed_linear's panels: AMX tiles where the CPU has them), one copy per each of
30 layers so that the weights are cold in the CPU's caches as in a step. Per row count: milliseconds for all 30
layers' linears and the rate at which they read the weights, against the machine's read bandwidth (a sum over
1 GiB) measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.bench.roofline import measure_read_bandwidth
from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.linear import panel_pack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of qkv, o, gate_up, down


def step(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for layer in weights:
        for (_, k), w in zip(SHAPES, layer):
            torch.ops.pagoda.packed_linear(xs[k], w, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 80])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    if not kernel_available():
        raise SystemExit("the C++ kernels did not build")
    g = torch.Generator().manual_seed(0)
    weights = [[panel_pack(torch.randn(n, k, generator=g).bfloat16()) for n, k in SHAPES] for _ in range(args.layers)]
    nbytes = sum(n * k * 2 for n, k in SHAPES) * args.layers
    bandwidth = measure_read_bandwidth()
    print(f"{args.layers} layers of SmolLM2's linears, bf16, {nbytes / 1e6:.0f} MB of weights, "
          f"{torch.get_num_threads()} threads; memory read {bandwidth / 1e9:.1f} GB/s")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES}
        for _ in range(3):
            step(weights, xs)
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            step(weights, xs)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"  {m:4d} rows: {med * 1e3:7.2f} ms, weights read at {nbytes / med / 1e9:5.1f} GB/s "
              f"({nbytes / med / bandwidth:.0%} of the read bandwidth)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
