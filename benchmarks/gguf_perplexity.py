"""Pagoda's perplexity on GGUF presets against llama.cpp's, on the same file and text:
`python -m benchmarks.gguf_perplexity [--presets Q4_K_M Q5_K_M] [--text-chars 40000]`.

Per preset (made from the embedded SmolLM2 by llama.cpp's own quantizer, as benchmarks/gguf_types.py does), three
perplexities over the same token windows, fp32:
- Pagoda exact (the default): the weights exactly as gguf-py dequantizes them, times float activations;
- Pagoda with `quant_activations="int8"`: each linear layer's input rounded per block as llama.cpp rounds it before
  its integer dot products (Q8_K for the K-quants and IQ4_XS, Q8_0 for the 32-value types: cpu/gguf_a8_linear.cpp),
  the numbers llama.cpp computes;
- llama.cpp (llama-cpp-python) on the file.
"""
from __future__ import annotations

import argparse

from benchmarks.gguf_types import corpus_ids, preset_files


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
        llm = LLM(path, quantization="gguf", dtype="float32", kv_cache_memory="256MiB", quant_activations="int8")
        rounded = perplexity(llm, ids, 256, 128).perplexity
        del llm
        peer = run_llama_cpp(path, python=args.llama_python, extra_bufts=False,
                             perplexity=([ids[w.begin:w.end] for w in windows],
                                         [w.end - w.begin - w.num_scored for w in windows]))
        rows[preset] = (exact, rounded, peer["perplexity"]["perplexity"])
    print(f"{len(ids)} tokens, windows of 256 every 128")
    print("| preset | Pagoda exact | Pagoda, int8 activations | llama.cpp |")
    print("|---|---|---|---|")
    for preset, (exact, rounded, theirs) in rows.items():
        print(f"| {preset} | {exact:.3f} ({exact / theirs - 1:+.2%}) | {rounded:.3f} ({rounded / theirs - 1:+.2%}) "
              f"| {theirs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
