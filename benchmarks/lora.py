"""Batched multi-LoRA against the base model: `python -m benchmarks.lora [--dtype bfloat16]`.

Four rank-16 adapters of every attention and MLP projection (made here with peft on the embedded SmolLM2's HF
copy, B random, not zero) serve 32 concurrent requests, 8 per adapter, in one engine; the same 32 requests then
run on the base model alone. Alternated `--rounds` times; prints output tok/s of each and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def make_adapters(base: str, out: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        torch.manual_seed(i)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.01)
        paths.append(out / f"adapter{i}")
        peft.save_pretrained(paths[-1])
    return paths


def run(llm, prompts, params, loras) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from pagoda import LLM, SamplingParams
    from pagoda.bench.hf_copy import ensure_hf_copy
    from pagoda.lora.request import LoRARequest
    from pagoda.model.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    base = ensure_hf_copy(default_model_path())
    with tempfile.TemporaryDirectory() as d:
        adapters = make_adapters(base, Path(d), args.adapters, args.rank)
        llm = LLM(base, dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                  kv_cache_memory="1GiB")
        loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
        spread = [loras[i % len(loras)] for i in range(args.requests)]
        prompts = [[1] + list(range(100 + 7 * i, 228 + 7 * i)) for i in range(args.requests)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
        run(llm, prompts[:4], params, spread[:4])  # warm-up: loads every adapter
        with_lora, base_only = [], []
        for _ in range(args.rounds):
            with_lora.append(run(llm, prompts, params, spread))
            base_only.append(run(llm, prompts, params, None))
            print(f"adapters {with_lora[-1]:.1f} tok/s, base {base_only[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    lo, ba = statistics.median(with_lora), statistics.median(base_only)
    print(f"{args.requests} requests over {args.adapters} adapters: {lo:.1f} tok/s; base alone {ba:.1f} tok/s; "
          f"ratio {lo / ba:.2f}x (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
