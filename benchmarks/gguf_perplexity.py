"""Where Pagoda's perplexity on a GGUF preset differs from llama.cpp's, and why:
`python -m benchmarks.gguf_perplexity [--presets Q4_K_M Q5_K_M] [--text-chars 40000]`.

Per preset (made from the embedded SmolLM2 by llama.cpp's own quantizer, as benchmarks/gguf_types.py does), three
perplexities over the same token windows, fp32:
- Pagoda as it runs: the weights exactly as gguf-py dequantizes them, times float activations;
- Pagoda with each linear layer's input rounded as llama.cpp rounds it before its integer dot products (Q8_K: blocks
  of 256 with scale max/-127 for the K-quants and IQ4_XS; Q8_0/Q8_1: blocks of 32 with an fp16 scale amax/127 for the
  32-value types), then the same kernels: the values llama.cpp multiplies, without its integer arithmetic;
- llama.cpp (llama-cpp-python) on the file.

The second row is a measurement of llama.cpp's numerics, not a way to run a model: it runs layer by layer (no C++
decoder stack) with the rounding applied in torch before each kernel call.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.gguf_types import corpus_ids, preset_files

# The types whose llama.cpp dot product takes Q8_K activations (ggml-cpu's type_traits_cpu vec_dot_type);
# every other GGUF block type takes Q8_0 or Q8_1, which round x alike.
Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's quantize_row_q8_K: per 256 values, the signed value of largest magnitude maps to
    -127, the rest to nearest integers (capped at 127), times the block's fp32 scale."""
    b = x.reshape(-1, 256)
    top = b.gather(1, b.abs().argmax(dim=1, keepdim=True))
    iscale = torch.where(top != 0, -127.0 / top, torch.zeros_like(top))
    q = torch.clamp(torch.round(iscale * b), max=127)
    return (q * torch.where(top != 0, 1.0 / iscale, torch.zeros_like(top))).reshape(x.shape)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as llama.cpp's quantize_row_q8_0 (and q8_1's values): per 32 values, scale amax / 127 stored as
    fp16, codes rounded to nearest."""
    b = x.reshape(-1, 32)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(b * torch.where(d != 0, 1.0 / d, torch.zeros_like(d)))
    return (q * d.half().float()).reshape(x.shape)


def llama_rounding():
    """A context in which every GGUF linear layer rounds its input as llama.cpp's vec_dot_type does, per segment
    of fused rows (a fused qkv may hold types of both kinds)."""
    import contextlib

    from gguf import GGMLQuantizationType

    import pagoda.kernels.linear_kernel as lk
    from pagoda.kernels.gguf_blocks import segments

    k_types = {int(GGMLQuantizationType[t]) for t in Q8_K_TYPES}
    plain = lk.quant_linear

    def rounded(x, pw, bias=None, use_cpp=False):
        if pw.format != "gguf":
            return plain(x, pw=pw, bias=bias, use_cpp=use_cpp)
        segs = segments(pw.scales)
        kinds = [t in k_types for t, _, _ in segs]
        outs = {k: plain((round_q8_k if k else round_q8_0)(x.float()).to(x.dtype), pw=pw, bias=bias, use_cpp=use_cpp)
                for k in set(kinds)}
        if len(outs) == 1:
            return outs[kinds[0]]
        cols, r0 = [], 0
        for k, (_, rows, _) in zip(kinds, segs):
            cols.append(outs[k][..., r0:r0 + rows])
            r0 += rows
        return torch.cat(cols, dim=-1)

    @contextlib.contextmanager
    def ctx():
        stack_args = lk.LinearKernel.stack_args
        lk.quant_linear, lk.LinearKernel.stack_args = rounded, lambda self: None  # layer by layer, through it
        try:
            yield
        finally:
            lk.quant_linear, lk.LinearKernel.stack_args = plain, stack_args

    return ctx()


def main(argv: list[str] | None = None) -> int:
    from pagoda import LLM
    from pagoda.bench.llama_cpp_peer import DEFAULT_LLAMA_PYTHON, run_llama_cpp
    from pagoda.eval.perplexity import perplexity, sliding_windows

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["Q4_K_M", "Q5_K_M"])
    p.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON)
    p.add_argument("--text-chars", type=int, default=40000)
    args = p.parse_args(argv)
    ids = corpus_ids(args.text_chars)
    windows = sliding_windows(len(ids), 256, 128)
    rows = {}
    for preset, path in preset_files(args.presets, args.llama_python):
        llm = LLM(path, quantization="gguf", dtype="float32", kv_cache_memory="256MiB")
        exact = perplexity(llm, ids, 256, 128).perplexity
        del llm
        with llama_rounding():
            llm = LLM(path, quantization="gguf", dtype="float32", kv_cache_memory="256MiB")
            rounded = perplexity(llm, ids, 256, 128).perplexity
            del llm
        peer = run_llama_cpp(path, python=args.llama_python, extra_bufts=False,
                             perplexity=([ids[w.begin:w.end] for w in windows],
                                         [w.end - w.begin - w.num_scored for w in windows]))
        rows[preset] = (exact, rounded, peer["perplexity"]["perplexity"])
    print(f"{len(ids)} tokens, windows of 256 every 128")
    print("| preset | Pagoda | Pagoda, x rounded as llama.cpp's | llama.cpp |")
    print("|---|---|---|---|")
    for preset, (exact, rounded, theirs) in rows.items():
        print(f"| {preset} | {exact:.3f} ({exact / theirs - 1:+.2%}) | {rounded:.3f} ({rounded / theirs - 1:+.2%}) "
              f"| {theirs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
