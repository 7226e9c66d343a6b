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
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from pagoda.bench.datasets import CORPUS_PATH, BenchRequest, load_corpus, synthetic_chat_requests

DEFAULT_ROWS = ["float32", "bfloat16", "int8", "int4", "fp8", "gguf"]
DEFAULT_TEXT = str(CORPUS_PATH)

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class RowSpec:
    name: str
    model: str | None
    dtype: str
    quantization: str | None
    int8_activations: bool = False  # INT4 layers with quant_activations="int8"


def parse_row(spec: str, model: str | None) -> RowSpec:
    """"float32" | "bfloat16" | a method name | "NAME=CHECKPOINT_DIR" (e.g. int4-awq=ckpt_awq); a NAME
    ending in "+a8" (int4+a8, gguf+a8, int4-awq+a8=DIR) runs its INT4 layers with INT8 activations."""
    name, path = spec.split("=", 1) if "=" in spec else (spec, None)
    a8 = name.endswith("+a8")
    method = name.removesuffix("+a8")
    if path is not None:
        return RowSpec(name, path, "auto", None, a8)
    if method in ("float32", "bfloat16"):
        return RowSpec(name, model, method, None, a8)
    return RowSpec(name, model, "auto", method, a8)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds (weight_bytes_by_format, summed)."""
    return sum(weight_bytes_by_format(model).values())


def weight_bytes_by_format(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of every weight the model holds (parameters, weight buffers, packed quantized weights), by the format
    they are held in (a float dtype, int4/int8/fp8, a GGUF block type), each storage counted once; the KV cache and
    RoPE tables are not weights, nor is the packed copy of a float weight (a Linear's matmul panels or oneDNN
    layout, a cache that float rows hold in addition), nor what the decoder stack holds (the layers' own tensors and
    the caches)."""
    import torch  # here: `--help` reads add_arguments without loading torch
    from gguf.constants import GGMLQuantizationType

    from pagoda.kernels.gguf_blocks import segments
    from pagoda.kernels.quant_linear import PackedWeight

    seen: set[int] = set()
    total: dict[str, int] = {}

    def add(t: torch.Tensor, label: str) -> bool:
        if t.device.type == "meta" or t.numel() == 0:
            return False
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return False
        seen.add(key)
        total[label] = total.get(label, 0) + t.untyped_storage().nbytes()
        return True

    def add_gguf(pw: PackedWeight) -> None:
        """The blocks by their GGML type: segment s runs from its offset to the next one's."""
        if not add(pw.scales, "gguf tables") or pw.data.untyped_storage().data_ptr() in seen:
            return
        seen.add(pw.data.untyped_storage().data_ptr())
        parts = segments(pw.scales)
        for (t, _, start), end in zip(parts, [o for _, _, o in parts[1:]] + [pw.data.numel()]):
            name = GGMLQuantizationType(t).name
            total[name] = total.get(name, 0) + end - start

    for m in model.modules():
        for name, value in [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]:
            if value is None or "cache" in name or name in ("cos", "sin", "k_scale", "v_scale", "matmul", "stack"):
                continue
            if isinstance(value, torch.Tensor):
                add(value, str(value.dtype).removeprefix("torch."))
            elif isinstance(value, PackedWeight) and value.format == "gguf":
                add_gguf(value)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                label = value.format if isinstance(value, PackedWeight) else type(value).__name__
                for f in dataclasses.fields(value):
                    v = getattr(value, f.name)
                    if isinstance(v, torch.Tensor):
                        add(v, label)
    return total


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS,
                   help="float32 bfloat16 int8 int4 fp8 gguf, or NAME=CHECKPOINT_DIR for a saved checkpoint; "
                        "NAME+a8 (int4+a8, gguf+a8, int4-awq+a8=DIR) with quant_activations=int8")
    p.add_argument("--compare", nargs="*", choices=["llama-cpp"], default=[])
    p.add_argument("--llama-python", default=None, metavar="PATH",
                   help="python of the llama-cpp-python venv, for --compare llama-cpp (default: the venv "
                        "scripts/install-peers.sh llama makes in the cache folder, ~/.cache/pagoda/peers/llama)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="perplexity text (default: GPL-3)")
    p.add_argument("--text-tokens", type=int, default=0, help="score only the first N tokens (default: all)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32, help="requests decoding at once for the throughput column")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--batch1-repeats", type=int, default=3,
                   help="batch-1 decode rounds over all rows, interleaved (and runs for llama.cpp); the fastest "
                        "per row is reported")
    p.add_argument("--decode-path-ppl", action="store_true",
                   help="also score the text in steps of at most 16 tokens, so that every linear runs its few-row "
                        "(decode) kernel, e.g. +a8 rows' INT8 activations (the ppl column runs prefill-sized steps)")
    p.add_argument("--kernels", default="auto", help="the C++ kernel build every row runs (auto, native, avx2, torch): "
                   "avx2 on an AVX-512 machine measures what CPUs without AVX-512 get")
    p.add_argument("--dtype", default="auto", help="compute dtype of the quantized rows (auto: bf16 where the CPU has "
                   "it natively; float32 is what CPUs without AVX512-BF16 run)")
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


def _load(row: RowSpec, args: argparse.Namespace, **extra: Any) -> Any:
    """The row's LLM: its dtype, quantization and INT4 activations."""
    from pagoda import LLM

    dtype = args.dtype if row.dtype == "auto" else row.dtype
    kw: dict[str, Any] = {"dtype": dtype, "kernels": args.kernels, "max_num_seqs": args.concurrency,
                          "kv_cache_memory": "2GiB",
                          "seed": args.seed, "quant_activations": "int8" if row.int8_activations else "float",
                          **extra}
    if row.quantization:
        kw["quantization"] = row.quantization
    return LLM(row.model, **kw)


def measure_row(row: RowSpec, reqs: list[BenchRequest], text_ids: list[int],
                args: argparse.Namespace) -> dict[str, Any]:
    """Weight bytes, perplexity and the concurrent throughput of one row (batch-1 decode: measure_batch1)."""
    from pagoda.bench.throughput import run_engine
    from pagoda.eval.perplexity import perplexity

    out: dict[str, Any] = {}
    if args.decode_path_ppl:
        small_steps = _load(row, args, max_num_batched_tokens=16)
        out["decode_path_perplexity"] = perplexity(small_steps, text_ids, args.max_length, args.stride).perplexity
        del small_steps
        gc.collect()
    t0 = time.perf_counter()
    llm = _load(row, args)
    load_s = time.perf_counter() - t0
    out.update(row=row.name, dtype=str(llm.engine.dtype).removeprefix("torch."),
               cpu_kernels=llm.engine.runner.policy.kernel_set,
               weight_bytes=weight_bytes(llm.engine.runner.model), load_s=load_s,
               weight_bytes_by_format=weight_bytes_by_format(llm.engine.runner.model))
    ppl = perplexity(llm, text_ids, args.max_length, args.stride)
    out.update(perplexity=ppl.perplexity, ppl_tok_s=ppl.tokens_per_s)
    out["throughput_out_tok_s"] = run_engine(llm, reqs).output_tok_s
    del llm
    gc.collect()
    return out


def measure_batch1(rows: list[RowSpec], prompt: list[int], args: argparse.Namespace) -> list[float]:
    """Batch-1 decode tok/s per row, the fastest of --batch1-repeats rounds. Every row is loaded at once
    (a small KV pool each) and the rounds go round-robin over the rows, so a slow minute of this noisy
    machine falls on every row alike instead of on whichever row it happened to be measuring."""
    from pagoda.bench.throughput import run_batch1_decode

    llms = [_load(row, args, kv_cache_memory="64MiB") for row in rows]
    best = [0.0] * len(rows)
    for _ in range(max(1, args.batch1_repeats)):
        for i, llm in enumerate(llms):
            best[i] = max(best[i], run_batch1_decode(llm, prompt, args.batch1_output_len).decode_tok_s)
    del llms
    gc.collect()
    return best


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
    return {"row": f"llama.cpp ({r['llama_cpp_version']})", "dtype": "gguf", "weight_bytes": os.path.getsize(gguf),
            "perplexity": r["perplexity"]["perplexity"],
            "batch1_decode_tok_s": r["batch1"]["decode_tokens"] / r["batch1"]["decode_s"],
            "throughput_out_tok_s": r["batched"]["output_tokens"] / r["batched"]["elapsed_s"]}


def print_table(rows: list[dict[str, Any]], base: dict[str, Any] | None) -> None:
    decode_ppl = any("decode_path_perplexity" in r for r in rows)
    print(f"{'row':<22} {'weights MB':>10} {'ppl':>8} {'ppl vs f32':>10} " + ("decode-path ppl " if decode_ppl else "")
          + f"{'b1 tok/s':>9} {'b1 vs f32':>9} {'thr tok/s':>9}")
    for r in rows:
        rel_p = f"{r['perplexity'] / base['perplexity'] - 1:+.1%}" if base else ""
        rel_b = f"{r['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:.2f}x" if base else ""
        dp = f"{r['decode_path_perplexity']:>15.3f} " if "decode_path_perplexity" in r else " " * 16
        print(f"{r['row']:<22} {r['weight_bytes'] / 1e6:>10.1f} {r['perplexity']:>8.3f} {rel_p:>10} "
              + (dp if decode_ppl else "")
              + f"{r['batch1_decode_tok_s']:>9.1f} {rel_b:>9} {r['throughput_out_tok_s']:>9.1f}")


def main(args: argparse.Namespace) -> int:
    from pagoda.model.default_model import default_model_path
    from pagoda.model.loader import resolve_model_files
    from pagoda.model.tokenizer import load_tokenizer

    model = args.model or default_model_path()
    tokenizer = load_tokenizer(resolve_model_files(model))
    reqs, text_ids, batch1_prompt = _workload(tokenizer, args)
    specs = [parse_row(spec, model) for spec in args.rows]
    rows = []
    for row in specs:
        print(f"measuring {row.name} ...", file=sys.stderr, flush=True)
        rows.append(measure_row(row, reqs, text_ids, args))
    print("measuring batch-1 decode, every row in turn ...", file=sys.stderr, flush=True)
    for r, tok_s in zip(rows, measure_batch1(specs, batch1_prompt, args)):
        r["batch1_decode_tok_s"] = tok_s
    if "llama-cpp" in args.compare:
        if not model.endswith(".gguf"):
            raise ValueError("--compare llama-cpp needs a .gguf model")
        print("measuring llama.cpp ...", file=sys.stderr, flush=True)
        rows.append(measure_llama_cpp(model, reqs, text_ids, batch1_prompt, args))
    base = next((r for r in rows if r["row"] == "float32"), None)
    print(f"text: {args.text} ({len(text_ids)} tokens, window {args.max_length}, stride {args.stride}); "
          f"throughput: {args.concurrency} requests x {args.output_len} output tokens, greedy, ignore_eos; "
          f"CPU kernels: {rows[0].get('cpu_kernels', '?')}")
    print_table(rows, base)
    for r in rows:
        if "weight_bytes_by_format" in r:
            print(f"{r['row']} weights by format: " + ", ".join(
                f"{k} {v / 1e6:.1f} MB" for k, v in sorted(r["weight_bytes_by_format"].items(), key=lambda kv: -kv[1])))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "args": {k: v for k, v in vars(args).items() if k != "func"}}, f, indent=1)
    return 0
