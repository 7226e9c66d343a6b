"""Batch-1 decode tokens/s of one checkout, for A/B runs against another:
`PYTHONPATH=CHECKOUT python -m benchmarks.batch1_decode --dtype bfloat16 [--quantization int4]`.

One greedy request (a 32-token prompt) decodes `--tokens` tokens after a warm-up, three times; the best of the
three is printed (other load on the machine only ever adds time). Alternate two checkouts process by process
(A B A B ...) and take the median of the per-pair ratios: the machine's memory bandwidth drifts by 10-30%
within minutes, so lone figures mean little.
"""
from __future__ import annotations

import argparse
import time

from pagoda import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quant-activations", default="float")
    ap.add_argument("--tokens", type=int, default=192)
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, kernels=args.kernels, quantization=args.quantization, kv_cache_memory="256MiB",
              quant_activations=args.quant_activations)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [list(range(100, 132))]
    llm.generate(prompt, params, use_tqdm=False)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        best = max(best, args.tokens / (time.perf_counter() - t0))
    print(f"{best:.1f}")


if __name__ == "__main__":
    main()
