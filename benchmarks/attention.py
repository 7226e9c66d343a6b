"""Time decode attention the way a step meets it: `python -m benchmarks.attention [--compare-source FILE]`.

A batch of decode queries (one per sequence, context lengths drawn log-uniformly, SmolLM2's 9/3 heads of
64) runs over every one of `--layers` layers' own paged caches, so the caches are cold in the CPU's caches
as in a real step (`--hot`: one layer's caches every time, which then stay in L3). The cache takes the
layout the engine allocates (kernels/paged_attention.py k_cache_shape). Milliseconds per step and the rate
of K/V bytes read.

`--compare-source FILE` builds another version of cpu/paged_attention.cpp (e.g. an earlier commit's:
`git show REV:pagoda/kernels/cpu/paged_attention.cpp > FILE`) as a second extension, registered under
another op namespace, gives it the same cache (K as rows where it does not take this checkout's layout), and
alternates calls between the two kernels in this process, so the machine's drift hits both alike.
"""
from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import time
from pathlib import Path

import torch

from pagoda.kernels import cpu_extension
from pagoda.kernels.build_spec import SRC_DIR
from pagoda.kernels.cpu_extension import best_build, build_directory, cflags, jit_build, kernel_available, loaded_build
from pagoda.kernels.kv_quant import kv_cache_format, quantize_kv
from pagoda.kernels.paged_attention import k_cache_shape, k_words


def load_other_kernel(source: Path) -> object:
    """`source` (a paged_attention.cpp) built with the loaded build's flags under the op namespace pagoda_cmp."""
    text = source.read_text()
    text = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)\(pagoda,", r"TORCH_LIBRARY\1(pagoda_cmp,", text)
    text = text.replace("namespace pagoda_cpu {", "namespace pagoda_cpu_cmp {")
    build = loaded_build() or best_build()
    out = build_directory().parent / f"attention_cmp_{build}"
    # Beside the build folder, not in it: jit_build clears a folder it has not finished building.
    src = out.with_name(out.name + "_src") / "paged_attention_cmp.cpp"
    src.parent.mkdir(parents=True, exist_ok=True)
    if not src.exists() or src.read_text() != text:
        src.write_text(text)
        shutil.rmtree(out, ignore_errors=True)  # a build of another source
    lib = jit_build("pagoda_attention_cmp", [src], [*cflags(build), f"-I{SRC_DIR}"], out,
                    label="attention comparison build")
    torch.ops.load_library(str(lib))
    return torch.ops.pagoda_cmp.paged_attention


def decode_batch(num_seqs: int, min_ctx: int, max_ctx: int, layers: int, block_size: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, prompts: list[int] | None = None):
    """Queries, per-layer K (as rows) and V caches, block tables (blocks shuffled in the pool) and lengths.
    `prompts`: instead of one decode query per sequence, whole prompts of these lengths (causal prefill)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 9, 3, 64
    u = torch.rand(num_seqs, generator=g)
    ctxs = prompts or [int(math.exp(math.log(min_ctx) + float(x) * (math.log(max_ctx) - math.log(min_ctx)))) for x in u]
    num_seqs = len(ctxs)
    nblk = [(c + block_size - 1) // block_size for c in ctxs]
    num_blocks = sum(nblk) + 8
    k = [torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(num_blocks, hkv, block_size, d, generator=g).to(dtype) for _ in range(layers)]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(num_seqs, max(nblk), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[used:used + n].int()
        used += n
    q_lens = ctxs if prompts else [1] * num_seqs
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, k, v, tables, qsl, torch.tensor(ctxs, dtype=torch.int32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--ctx-range", type=int, nargs=2, default=(46, 286), metavar=("MIN", "MAX"))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--hot", action="store_true", help="one layer's caches every time (they stay in L3)")
    p.add_argument("--compare-source", type=Path, default=None, metavar="FILE")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of queries and cache")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"], default="auto",
                   help="the cache's storage (auto: --dtype; else 8-bit with a scale per token and head)")
    p.add_argument("--kernels", default=None, help="the kernel build to load (native, avx2; default: the best)")
    p.add_argument("--prefill", default=None, metavar="LENS", help="comma-separated prompt lengths: time their causal "
                   "prefill instead of decode")
    args = p.parse_args(argv)
    if args.kernels is not None:
        cpu_extension.load(args.kernels)
    if not kernel_available():
        raise SystemExit("the C++ kernels did not build")
    dtype = getattr(torch, args.dtype)
    prompts = [int(n) for n in args.prefill.split(",")] if args.prefill else None
    q, k, v, tables, qsl, lens = decode_batch(args.num_seqs, *args.ctx_range, args.layers, args.block_size,
                                              dtype=dtype, prompts=prompts)
    fmt = kv_cache_format(args.kv_cache_dtype, dtype)
    scales: list[tuple[torch.Tensor, torch.Tensor] | tuple[()]] = [()] * args.layers
    if fmt.quantized:  # the rows and scales the engine's KV write stores
        (k, ks), (v, vs) = zip(*[quantize_kv(t, fmt.dtype) for t in k]), zip(*[quantize_kv(t, fmt.dtype) for t in v])
        scales = list(zip(ks, vs))
    shape = k_cache_shape(*k[0].shape, k[0].dtype)
    kw = [k_words(t) for t in k] if len(shape) == 5 else k
    if args.hot:
        k, kw, v, scales = [k[0]] * args.layers, [kw[0]] * args.layers, [v[0]] * args.layers, [scales[0]] * args.layers
    kernels = {"pagoda": (torch.ops.pagoda.paged_attention, kw)}
    if args.compare_source is not None:
        other = load_other_kernel(args.compare_source)
        try:  # the cache layout this checkout's kernel takes, where the other takes it too
            other(q, kw[0], v[0], tables, qsl, lens, 64 ** -0.5, *scales[0])
            kernels[f"other ({args.compare_source.name})"] = (other, kw)
        except RuntimeError:  # an older kernel: K as rows
            kernels[f"other ({args.compare_source.name})"] = (other, k)
    scale = 64 ** -0.5
    outs = {name: op(q, ks[0], v[0], tables, qsl, lens, scale, *scales[0]) for name, (op, ks) in kernels.items()}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, (op, ks) in kernels.items():
            t0 = time.perf_counter()
            for layer in range(args.layers):
                op(q, ks[layer], v[layer], tables, qsl, lens, scale, *scales[layer])
            times[name].append(time.perf_counter() - t0)
    kv_bytes = int(lens.sum()) * 3 * 2 * fmt.bytes_per_row(64) * args.layers
    kind = "prefill" if prompts else "decode"
    cache = f", KV {args.kv_cache_dtype}" if fmt.quantized else ""
    print(f"{kind} attention ({loaded_build()} build, {args.dtype}{cache}): {len(lens)} sequences, "
          f"{int(lens.sum())} keys, "
          f"{args.layers} layers "
          f"({'hot' if args.hot else 'cold'}), K/V {kv_bytes / 1e6:.0f} MB a step, K layout {list(shape)}")
    base = statistics.median(times["pagoda"])
    for name, ts in times.items():
        med = statistics.median(ts)
        line = f"  {name:28s} median {med * 1e3:7.2f} ms  min {min(ts) * 1e3:7.2f} ms  {kv_bytes / med / 1e9:5.1f} GB/s"
        if name != "pagoda":
            diff = (outs[name].float() - outs["pagoda"].float()).abs().max().item()
            line += f"  pagoda / this: {med / base:.2f}x faster (outputs differ by <= {diff:.1e})"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
