"""The `pagoda` command: generate, chat, serve, bench."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM's (and as LLM(...)'s keyword arguments)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto = bfloat16 where the CPU has native bf16, else float32")
    p.add_argument("--max-num-seqs", type=int, default=None, help="max sequences per step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 512)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes or e.g. 2GiB (default: a share of free RAM, at most 4 GiB)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt prefixes across requests (default on)")
    p.add_argument("--quantization", "-q", default=None,
                   help="weight quantization: int8, int4, fp8 or gguf (default: weights as stored)")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4 group size (default 128; 64/32 where the input size needs it)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage dtype (default auto = the compute dtype)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = ["dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "max_model_len", "seed",
            "enable_prefix_caching", "quantization", "kv_cache_dtype", "speculative_config",
            "quantization_group_size"]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)


def _sampling(args: argparse.Namespace):  # noqa: ANN202
    from pagoda import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    outs = llm.generate(args.prompt, _sampling(args), use_tqdm=False)
    for prompt, out in zip(args.prompt, outs):
        print(f"{prompt}{out.outputs[0].text}")
        if len(args.prompt) > 1:
            print("-" * 40)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat that streams tokens as the engine makes them."""
    from pagoda import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    engine, tok = llm.engine, llm.engine.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pagoda chat: type a message, /reset to start over, Ctrl-D to quit.")
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        req = engine.add_request(ids, _sampling(args))
        shown = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
        print()
        messages.append({"role": "assistant", "content": req.seqs[0].text})


# Subcommands living in their own modules: name -> (module, help). Each module has add_arguments(p), main(args).
_PLUGINS = {
    "serve": ("pagoda.entrypoints.server.cli", "start the OpenAI-compatible HTTP server"),
    "quantize": ("pagoda.quantization.cli", "write an INT4 (RTN/GPTQ/AWQ) checkpoint calibrated on a text file"),
}
_BENCH = {
    "throughput": ("pagoda.bench.throughput", "offline throughput benchmark (vs HF, roofline)"),
    "serve": ("pagoda.bench.serve", "load generator for any OpenAI-compatible server"),
    "quant": ("pagoda.bench.quant_table", "weight formats side by side: bytes, perplexity, decode, throughput"),
}
_EVAL = {
    "perplexity": ("pagoda.eval.perplexity", "sliding-window perplexity of a text file"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming")
    c.add_argument("--model", default=None)
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat, temperature=0.7)

    for name, (module, help_text) in _PLUGINS.items():
        _add_plugin(sub, name, module, help_text)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCH.items():
        _add_plugin(bsub, name, module, help_text)
    e = sub.add_parser("eval", help="quality evaluations")
    esub = e.add_subparsers(dest="eval", required=True)
    for name, (module, help_text) in _EVAL.items():
        _add_plugin(esub, name, module, help_text)
    return parser


def _add_plugin(sub: Any, name: str, module: str, help_text: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # a real import error inside the module must surface
            raise
        return
    p = sub.add_parser(name, help=help_text)
    mod.add_arguments(p)
    p.set_defaults(func=mod.main)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
