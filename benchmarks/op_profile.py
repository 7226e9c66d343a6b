"""Where a 32-request run's time goes, op by op: `python -m benchmarks.op_profile [--kernels avx2] [--quantization X
[--quant-activations int8]]`.

The workload of `pagoda bench quant`'s throughput column (32 synthetic chat prompts of 16-512 tokens, 128 greedy
tokens each) under torch.profiler, with the C++ decoder stack off so that each layer's ops (linears, attention,
norms, SiLU-and-mul) show as their own rows; the stack runs the same kernels in one call. Prints the tokens/s of an
unprofiled run and the profile's top ops by self CPU time.
"""
from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from pagoda import LLM
from pagoda.bench.datasets import BenchRequest, synthetic_chat_requests
from pagoda.bench.throughput import run_engine
from pagoda.kernels.decoder_stack import DecoderStack


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--quant-activations", default="float", choices=["float", "int8"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=12, help="ops printed")
    args = p.parse_args(argv)
    DecoderStack.takes = lambda self, x: False  # layer by layer: every op its own profiler row
    kw = {"quantization": args.quantization, "quant_activations": args.quant_activations} if args.quantization else {}
    llm = LLM(dtype=args.dtype, kernels=args.kernels, max_num_seqs=args.concurrency, kv_cache_memory="2GiB", seed=0,
              kv_cache_dtype=args.kv_cache_dtype,
              **kw)
    reqs = [BenchRequest(r.prompt_token_ids, args.output_len)
            for r in synthetic_chat_requests(llm.get_tokenizer(), num_prompts=args.concurrency, seed=0)]
    a8 = "+a8" if args.quantization and args.quant_activations == "int8" else ""
    print(f"{llm.engine.runner.policy.kernel_set} kernels, {args.dtype}, {args.quantization or 'dense'}{a8}, "
          f"KV {args.kv_cache_dtype}: "
          f"{run_engine(llm, reqs).output_tok_s:.1f} tok/s unprofiled")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_engine(llm, reqs)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
