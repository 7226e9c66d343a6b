"""Batch-1 decode against llama.cpp, paired: `python -m benchmarks.batch1_paired --llama-python PATH [--kernels avx2]
[--quant-activations int8]`.

`pagoda bench quant` measures llama.cpp's batch 1 a minute after Pagoda's, and this machine's bandwidth drifts by
10-30% within minutes. Here one process holds Pagoda's model and alternates with llama.cpp's peer (its own process
per round) `--pairs` times, each the best of `--repeats` decodes of `--tokens` tokens after a 32-token prompt, and
prints every pair's ratio and their median. Decode time only (after the first token), on both sides.
"""
from __future__ import annotations

import argparse
import statistics

from pagoda import LLM
from pagoda.bench.llama_cpp_peer import DEFAULT_LLAMA_PYTHON, run_llama_cpp
from pagoda.bench.throughput import run_batch1_decode
from pagoda.model.default_model import default_model_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF both engines load (default: the embedded SmolLM2)")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--quant-activations", default="float", choices=["float", "int8"])
    p.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    gguf = args.model or default_model_path()
    llm = LLM(gguf, dtype=args.dtype, kernels=args.kernels, quantization=args.quantization,
              quant_activations=args.quant_activations, kv_cache_memory="256MiB")
    prompt = list(range(100, 132))
    run_batch1_decode(llm, prompt, args.tokens)  # warm-up
    ratios = []
    for i in range(args.pairs):
        ours = max(run_batch1_decode(llm, prompt, args.tokens).decode_tok_s for _ in range(args.repeats))
        b1 = run_llama_cpp(gguf, python=args.llama_python, batch1=(prompt, args.tokens),
                           batch1_repeats=args.repeats)["batch1"]
        theirs = (args.tokens - 1) / b1["decode_s"]
        ratios.append(ours / theirs)
        print(f"pair {i}: pagoda {ours:.1f} tok/s, llama.cpp {theirs:.1f} tok/s, ratio {ours / theirs:.2f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f} ({llm.engine.runner.policy.kernel_set} kernels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
