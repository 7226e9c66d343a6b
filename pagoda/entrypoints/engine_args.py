"""The engine's flags, named as vLLM's and as LLM(...)'s keyword arguments: one definition for every command
that builds an engine (generate, chat, serve, bench, eval, batch, train-eagle)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from pagoda.kernels.policy import KERNEL_TUNING, KERNELS, QUANT_ACTIVATIONS


def add_engine_args(p: argparse.ArgumentParser, decoding: bool = True) -> None:
    """Engine flags, named as vLLM's (and as LLM(...)'s keyword arguments). `decoding=False` leaves out those
    that only matter to generated tokens (speculation, structured outputs), for commands that only score text."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype; auto = bfloat16 where the CPU has native bf16, else float32; "
                        "float16 computes in bfloat16 (native) or float32 on CPU")
    p.add_argument("--max-num-seqs", type=int, default=None, help="max sequences per step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 512)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size in bytes or e.g. 2GiB (default: what max-num-seqs sequences of "
                        "max-model-len tokens need, at most 25%% of free RAM and 4 GiB)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--seed", type=int, default=None,
                   help="engine seed, also the requests' sampling seed (default: 0, requests unseeded)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt prefixes across requests (default on)")
    p.add_argument("--quantization", "-q", default=None,
                   help="weight quantization: int8, int4, fp8 or gguf (default: weights as stored)")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4 group size (default 128; 64/32 where the input size needs it)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage dtype (default auto = the compute dtype)")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve PEFT LoRA adapters of the model, several in one batch (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapters resident at once; the least recently used idle one is replaced (default 4)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest LoRA rank served (default 16)")
    if decoding:
        p.add_argument("--scheduling-policy", default=None, choices=["priority", "fcfs"],
                       help="priority (default): requests go by their `priority` field, lower first, and may take a "
                            "running request's seat; fcfs: the field is ignored")
        p.add_argument("--speculative-config", type=_json_object, default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                            "(default: none)")
        p.add_argument("--structured-outputs-backend", default=None, choices=["auto", "xgrammar", "guidance"],
                       help="grammar library for structured outputs (default: auto = xgrammar, falling back to "
                            "llguidance for a constraint xgrammar rejects, or for all where it is not installed)")
        p.add_argument("--structured-outputs-jump-forward", action=argparse.BooleanOptionalAction, default=None,
                       help="append the text a grammar forces in one step instead of one step per token "
                            "(default on)")
    p.add_argument("--kernels", default=None, choices=list(KERNELS),
                   help="auto: the best build of Pagoda's C++ CPU kernels for this CPU (an error where it cannot "
                        "build); native: the -march=native build; avx2: the x86-64-v3 build (AVX2+FMA, no AVX-512); "
                        "torch: torch ops only (default auto)")
    p.add_argument("--quant-activations", "--int4-activations", dest="quant_activations", default=None,
                   choices=list(QUANT_ACTIVATIONS),
                   help="int8: quantized linears (INT4, GGUF blocks) round their activations to int8 per block and "
                        "compute with integer dot products, as llama.cpp does (VNNI, AVX2, Arm dot products; faster "
                        "on CPUs without AVX512-BF16, slightly different perplexity: docs/benchmarks.md) "
                        "(default float; --int4-activations is its former name)")
    p.add_argument("--kernel-tuning", default=None, choices=list(KERNEL_TUNING),
                   help="auto: where several C++ kernels can serve a linear layer's shape, time them once on this "
                        "machine and keep the fastest (cached beside the kernel build); off: the built-in choice "
                        "(default auto)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model over this many ranks: processes spawned on this host, each bound to its "
                        "share of the cores; across hosts, start every rank with torchrun (default 1)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="run on these cores only, e.g. 0-3,6 (default: the cores this process may use)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: one per usable core, capped by a container's CPU quota, and "
                        "fewer while other processes keep some of those cores busy; OMP_NUM_THREADS where set)")


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (--speculative-config); EngineConfig parses what it holds."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given, as LLM(...)'s keyword arguments (a flag left unset leaves config's default)."""
    keys = ["dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "max_model_len", "seed",
            "scheduling_policy", "enable_prefix_caching", "quantization", "kv_cache_dtype", "speculative_config",
            "quantization_group_size", "structured_outputs_backend", "structured_outputs_jump_forward", "kernels",
            "quant_activations", "kernel_tuning", "tensor_parallel_size", "cpus", "threads",
            "structured_outputs_compile_workers",
            "structured_outputs_compile_timeout", "structured_outputs_compile_memory",
            "enable_lora", "max_loras", "max_lora_rank"]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def check_model(model: str | None) -> None:
    """A missing model fails here, before the seconds of importing torch and loading anything."""
    if model is not None:
        from pagoda.model.locate import locate_model

        locate_model(model)
