"""`pagoda bench quant`: one table of weight formats, measured side by side in one run.

Per row (float32, bfloat16, int8, int4 RTN, GPTQ/AWQ checkpoints, fp8, GGUF native, and llama.cpp on
the same GGUF): weight bytes, perplexity on a real text (sliding window, the same token ids for every
row, llama.cpp included), batch-1 decode tokens/s, and output tokens/s with N requests decoding at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from typing import Any

import torch

from pagoda.bench.datasets import BenchRequest, load_corpus, synthetic_chat_requests

DEFAULT_ROWS = ["float32", "bfloat16", "int8", "int4", "fp8", "gguf"]
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


@dataclasses.dataclass
class RowSpec:
    name: str
    model: str | None
    dtype: str
    quantization: str | None


def parse_row(spec: str, model: str | None) -> RowSpec:
    """"float32" | "bfloat16" | a method name | "NAME=CHECKPOINT_DIR" (e.g. int4-awq=/tmp/awq)."""
    if "=" in spec:
        name, path = spec.split("=", 1)
        return RowSpec(name, path, "auto", None)
    if spec in ("float32", "bfloat16"):
        return RowSpec(spec, model, spec, None)
    return RowSpec(spec, model, "auto", spec)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds (parameters, weight buffers, packed quantized weights),
    each storage counted once; the KV cache and RoPE tables are not weights, nor is oneDNN's prepacked
    copy of a float weight (Linear.packed, an opaque layout cache that float rows hold in addition)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.device.type == "meta" or t.numel() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for m in model.modules():
        for name, value in [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]:
            if value is None or "cache" in name or name in ("cos", "sin", "k_scale", "v_scale", "packed"):
                continue
            if isinstance(value, torch.Tensor):
                add(value)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    v = getattr(value, f.name)
                    if isinstance(v, torch.Tensor):
                        add(v)
    return total


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS,
                   help="float32 bfloat16 int8 int4 fp8 gguf, or NAME=CHECKPOINT_DIR for a saved checkpoint")
    p.add_argument("--compare", nargs="*", choices=["llama-cpp"], default=[])
    p.add_argument("--llama-python", default=None, help="python of the llama-cpp-python venv")
    p.add_argument("--text", default=DEFAULT_TEXT, help="perplexity text (default: GPL-3)")
    p.add_argument("--text-tokens", type=int, default=0, help="score only the first N tokens (default: all)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="requests decoding at once for the throughput column")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--batch1-repeats", type=int, default=3,
                   help="batch-1 decode runs per row (and for llama.cpp); the fastest is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def _workload(tokenizer: Any, args: argparse.Namespace) -> tuple[list[BenchRequest], list[int], list[int]]:
    reqs = synthetic_chat_requests(tokenizer, num_prompts=args.concurrency, seed=args.seed)
    reqs = [BenchRequest(r.prompt_token_ids, args.output_len) for r in reqs]
    text_ids = tokenizer.encode(load_corpus(args.text), add_special_tokens=False)
    if args.text_tokens:
        text_ids = text_ids[:args.text_tokens]
    batch1_prompt = text_ids[:32]
    return reqs, text_ids, batch1_prompt


def measure_row(row: RowSpec, reqs: list[BenchRequest], text_ids: list[int], batch1_prompt: list[int],
                args: argparse.Namespace) -> dict[str, Any]:
    from pagoda import LLM
    from pagoda.bench.throughput import run_batch1_decode, run_engine
    from pagoda.eval.perplexity import perplexity

    kw: dict[str, Any] = {"dtype": row.dtype, "max_num_seqs": args.concurrency, "kv_cache_memory": "2GiB",
                          "seed": args.seed}
    if row.quantization:
        kw["quantization"] = row.quantization
    t0 = time.perf_counter()
    llm = LLM(row.model, **kw)
    load_s = time.perf_counter() - t0
    out: dict[str, Any] = {"row": row.name, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                           "weight_bytes": weight_bytes(llm.engine.runner.model), "load_s": load_s}
    ppl = perplexity(llm, text_ids, args.max_length, args.stride)
    out.update(perplexity=ppl.perplexity, ppl_tok_s=ppl.tokens_per_s)
    llm.reset_prefix_cache()
    out["batch1_decode_tok_s"] = max(run_batch1_decode(llm, batch1_prompt, args.batch1_output_len).decode_tok_s
                                     for _ in range(max(1, args.batch1_repeats)))
    thr = run_engine(llm, reqs)
    out["throughput_out_tok_s"] = thr.output_tok_s
    del llm
    gc.collect()
    return out


def measure_llama_cpp(gguf: str, reqs: list[BenchRequest], text_ids: list[int], batch1_prompt: list[int],
                      args: argparse.Namespace) -> dict[str, Any]:
    from pagoda.bench.llama_cpp_peer import DEFAULT_LLAMA_PYTHON, run_llama_cpp
    from pagoda.eval.perplexity import sliding_windows

    windows = sliding_windows(len(text_ids), args.max_length, args.stride)
    r = run_llama_cpp(gguf, python=args.llama_python or DEFAULT_LLAMA_PYTHON,
                      batch1=(batch1_prompt, args.batch1_output_len), batch1_repeats=args.batch1_repeats,
                      batched=([q.prompt_token_ids for q in reqs], [q.output_len for q in reqs]),
                      perplexity=([text_ids[w.begin:w.end] for w in windows],
                                  [w.end - w.begin - w.num_scored for w in windows]))
    import os
    return {"row": f"llama.cpp ({r['llama_cpp_version']})", "dtype": "gguf", "weight_bytes": os.path.getsize(gguf),
            "perplexity": r["perplexity"]["perplexity"],
            "batch1_decode_tok_s": r["batch1"]["decode_tokens"] / r["batch1"]["decode_s"],
            "throughput_out_tok_s": r["batched"]["output_tokens"] / r["batched"]["elapsed_s"]}


def print_table(rows: list[dict[str, Any]], base: dict[str, Any] | None) -> None:
    print(f"{'row':<22} {'weights MB':>10} {'ppl':>8} {'ppl vs f32':>10} {'b1 tok/s':>9} {'b1 vs f32':>9} "
          f"{'thr tok/s':>9}")
    for r in rows:
        rel_p = f"{r['perplexity'] / base['perplexity'] - 1:+.1%}" if base else ""
        rel_b = f"{r['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:.2f}x" if base else ""
        print(f"{r['row']:<22} {r['weight_bytes'] / 1e6:>10.1f} {r['perplexity']:>8.3f} {rel_p:>10} "
              f"{r['batch1_decode_tok_s']:>9.1f} {rel_b:>9} {r['throughput_out_tok_s']:>9.1f}")


def main(args: argparse.Namespace) -> int:
    from pagoda.model.default_model import default_model_path
    from pagoda.model.loader import resolve_model_files
    from pagoda.model.tokenizer import load_tokenizer

    model = args.model or default_model_path()
    tokenizer = load_tokenizer(resolve_model_files(model))
    reqs, text_ids, batch1_prompt = _workload(tokenizer, args)
    rows = []
    for spec in args.rows:
        row = parse_row(spec, model)
        print(f"measuring {row.name} ...", file=sys.stderr, flush=True)
        rows.append(measure_row(row, reqs, text_ids, batch1_prompt, args))
    if "llama-cpp" in args.compare:
        if not model.endswith(".gguf"):
            raise ValueError("--compare llama-cpp needs a .gguf model")
        print("measuring llama.cpp ...", file=sys.stderr, flush=True)
        rows.append(measure_llama_cpp(model, reqs, text_ids, batch1_prompt, args))
    base = next((r for r in rows if r["row"] == "float32"), None)
    print(f"text: {args.text} ({len(text_ids)} tokens, window {args.max_length}, stride {args.stride}); "
          f"throughput: {args.concurrency} requests x {args.output_len} output tokens, greedy, ignore_eos")
    print_table(rows, base)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "args": {k: v for k, v in vars(args).items() if k != "func"}}, f, indent=1)
    return 0
