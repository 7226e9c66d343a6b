"""GGUF presets as people download them, against llama.cpp on the same files:
`python -m benchmarks.gguf_types [--presets Q4_K_M Q5_K_M ...] [--kernels avx2 --dtype float32 --llama-python PY]
[--quant-activations int8]`.

The embedded SmolLM2's weights (its Q4_1 file dequantized) are written as an F16 GGUF (gguf-py), and llama.cpp's
own quantizer (llama-cpp-python's `llama_model_quantize`, from `bash scripts/install-peers.sh llama`) makes each
preset from it, as `pagoda quantize --gguf PRESET` does (pagoda/quantization/gguf_export.py). Per file: the tensor
types it holds, its size against Pagoda's resident weight bytes under `-q gguf` (as stored), perplexity on the same
token windows (Pagoda fp32 against llama.cpp), batch-1 decode and 32 concurrent requests (Pagoda bf16 against
llama.cpp, two threads each). Prints one table. `--quant-activations int8` runs Pagoda's every column with activations
rounded to int8 per block as llama.cpp rounds them (integer dot products, cpu/gguf_a8_linear.cpp).

`--kernels avx2` measures what a CPU without AVX-512 gets: run it with `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`, `--dtype float32` (such CPUs have no bf16 arithmetic) and llama.cpp built for AVX2
(`bash scripts/install-peers.sh llama-avx2`, `--llama-python ~/.cache/pagoda/peers/llama-avx2/bin/python`).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


def tensor_types(path: str) -> str:
    from pagoda.quantization.gguf_export import tensor_types as counts

    return ", ".join(f"{n} {k}" for k, n in counts(path, matrices_only=True).most_common())


def measure(path: str, python: str, ids: list[int], extra_bufts: bool, kernels: str, dtype: str,
            quant_activations: str = "float") -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.bench.llama_cpp_peer import run_llama_cpp
    from pagoda.bench.quant_table import weight_bytes
    from pagoda.eval.perplexity import perplexity, sliding_windows

    row: dict = {"file_mib": Path(path).stat().st_size / 2**20, "types": tensor_types(path)}
    llm = LLM(path, quantization="gguf", dtype="float32", kv_cache_memory="128MiB", kernels=kernels,
              quant_activations=quant_activations)
    row["resident_mib"] = weight_bytes(llm.engine.runner.model) / 2**20
    row["ppl"] = perplexity(llm, ids, 256, 128).perplexity
    del llm
    windows = sliding_windows(len(ids), 256, 128)
    prompt = ids[:32]
    peer = run_llama_cpp(path, python=python, perplexity=([ids[w.begin:w.end] for w in windows],
                                                          [w.end - w.begin - w.num_scored for w in windows]),
                         batch1=(prompt, 128), batch1_repeats=2, batched=([prompt] * 32, [64] * 32),
                         extra_bufts=extra_bufts)
    row["llama_ppl"] = peer["perplexity"]["perplexity"]
    row["llama_b1"] = 127 / peer["batch1"]["decode_s"]
    row["llama_32"] = peer["batched"]["output_tokens"] / peer["batched"]["elapsed_s"]
    llm = LLM(path, quantization="gguf", dtype=dtype, kv_cache_memory="256MiB", kernels=kernels,
              quant_activations=quant_activations)
    from pagoda.bench.throughput import run_batch1_decode

    run_batch1_decode(llm, prompt, 16)
    row["b1"] = max(run_batch1_decode(llm, prompt, 128).decode_tok_s for _ in range(2))
    import time

    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * 32, params, use_tqdm=False)
    row["c32"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    return row


def corpus_ids(chars: int, kernels: str = "auto") -> list[int]:
    """The first `chars` characters of the bundled GPL-3 text, as the embedded model's tokens."""
    from pagoda import LLM

    corpus = Path(__file__).resolve().parents[1] / "pagoda" / "bench" / "corpus" / "GPL-3"
    tokenizer = LLM(dtype="float32", kv_cache_memory="32MiB", kernels=kernels).get_tokenizer()
    return tokenizer.encode(corpus.read_text()[:chars])


def preset_files(presets: list[str], llama_python: str) -> Iterator[tuple[str, str]]:
    """(preset, path) per preset: the embedded model's weights as an F16 GGUF, quantized by llama.cpp's own
    quantizer, in a folder that lives as long as the iteration."""
    from pagoda.model.default_model import default_model_path
    from pagoda.quantization.gguf_export import gguf_source, write_gguf
    from pagoda.quantization.llama_quantizer import llama_quantize

    with tempfile.TemporaryDirectory() as d:
        f16 = str(Path(d) / "f16.gguf")
        write_gguf(gguf_source(default_model_path()), f16, "F16")
        for preset in presets:
            path = str(Path(d) / f"{preset}.gguf")
            llama_quantize(f16, path, preset, llama_python, threads=2)
            yield preset, path


def main(argv: list[str] | None = None) -> int:
    from pagoda.bench.llama_cpp_peer import DEFAULT_LLAMA_PYTHON

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_M"])
    p.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON)
    p.add_argument("--text-chars", type=int, default=6000)
    p.add_argument("--no-extra-bufts", action="store_true",
                   help="llama.cpp without its repacked/AMX weight buffers (where its build crashes in them)")
    p.add_argument("--kernels", default="auto", help="the C++ kernel build Pagoda runs (auto, native, avx2)")
    p.add_argument("--dtype", default="bfloat16", help="Pagoda's compute dtype for the speed columns")
    p.add_argument("--quant-activations", default="float", choices=("float", "int8"),
                   help="int8: Pagoda rounds each linear's input to int8 per block, as llama.cpp does")
    args = p.parse_args(argv)
    ids = corpus_ids(args.text_chars, args.kernels)
    rows = {}
    for preset, path in preset_files(args.presets, args.llama_python):
        rows[preset] = measure(path, args.llama_python, ids, not args.no_extra_bufts, args.kernels, args.dtype,
                               args.quant_activations)
        print(preset, rows[preset], file=sys.stderr, flush=True)
    print("| preset | tensors | file | resident (-q gguf) | ppl Pagoda / llama.cpp | batch 1 | 32 concurrent |")
    print("|---|---|---|---|---|---|---|")
    for preset, r in rows.items():
        print(f"| {preset} | {r['types']} | {r['file_mib']:.1f} MiB | {r['resident_mib']:.1f} MiB "
              f"({r['resident_mib'] / r['file_mib']:.2f}x) | {r['ppl']:.3f} / {r['llama_ppl']:.3f} "
              f"({r['ppl'] / r['llama_ppl'] - 1:+.2%}) | {r['b1']:.1f} vs {r['llama_b1']:.1f} tok/s "
              f"({r['b1'] / r['llama_b1']:.2f}x) | {r['c32']:.1f} vs {r['llama_32']:.1f} tok/s "
              f"({r['c32'] / r['llama_32']:.2f}x) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
