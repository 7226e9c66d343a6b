"""Microseconds per call of the small fused ops at SmolLM2's shapes: `python -m benchmarks.fused_ops [--kernels avx2]`.

RMSNorm (alone and with the residual add), SiLU-and-mul, RoPE on the fused qkv row, argmax over the vocabulary and
the int8 KV-cache write, at 1, 32 and 256 rows, fp32 and bf16; best of `--rounds` rounds of `--calls` calls, on
`--threads` threads (default one; other work on the machine only ever adds time). A/B two checkouts by alternating
processes: `PYTHONPATH=CHECKOUT python benchmarks/fused_ops.py` (this file runs against whichever pagoda it imports).
"""
from __future__ import annotations

import argparse
import time

import torch

from pagoda.kernels import cpu_extension

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152


def cases(t: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    res = torch.randn(t, HIDDEN, generator=g).to(dtype)
    gu = torch.randn(t, 2 * INTER, generator=g).to(dtype)
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    pos = torch.arange(t, dtype=torch.long)
    cos, sin = torch.randn(4096, HEAD_DIM // 2, generator=g), torch.randn(4096, HEAD_DIM // 2, generator=g)
    logits = torch.randn(t, VOCAB, generator=g).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    kc, vc = (torch.zeros(t, KV_HEADS, 1, HEAD_DIM, dtype=torch.int8) for _ in range(2))
    ks, vs = torch.zeros(t, KV_HEADS, 1), torch.zeros(t, KV_HEADS, 1)
    slots = torch.arange(t, dtype=torch.long)
    ops = torch.ops.pagoda
    return {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-5, None),
        "rms_norm+res": lambda: ops.rms_norm(x, w, 1e-5, res),
        "silu_and_mul": lambda: ops.silu_and_mul(gu),
        "rope": lambda: ops.rope_(qkv, pos, cos, sin, HEADS, KV_HEADS, HEAD_DIM),
        "argmax": lambda: ops.argmax_rows(logits),
        "write_kv int8": lambda: ops.write_kv_(k, k, kc, vc, slots, ks, vs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=None, help="the kernel build to load (native, avx2; default: the best)")
    p.add_argument("--rows", default="1,32,256")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    cpu_extension.load(args.kernels)
    torch.set_num_threads(args.threads)
    print(f"{cpu_extension.loaded_build()} build, {args.threads} thread(s), us a call")
    for dtype in (torch.float32, torch.bfloat16):
        for t in (int(r) for r in args.rows.split(",")):
            cells = []
            for name, fn in cases(t, dtype).items():
                best = float("inf")
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    best = min(best, (time.perf_counter() - t0) / args.calls)
                cells.append(f"{name} {best * 1e6:8.1f}")
            print(f"{str(dtype).removeprefix('torch.'):9s} T={t:4d}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
