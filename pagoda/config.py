"""Engine configuration: one dataclass per concern, vLLM's names for every knob."""
from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from pagoda.core.draft_tree import TokenTree
from pagoda.kernels.cpu_features import has_native_bf16
from pagoda.kernels.kv_quant import check_kv_cache_dtype
from pagoda.kernels.policy import KernelPolicy, check_kernels

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40}


def parse_memory(value: int | float | str | None) -> int | None:
    """Parse a byte count given as an int or a string such as "2GiB", "512MB", "1.5G"."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (use bytes or e.g. '2GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def server_api_key(flag: str | None) -> str | None:
    """The server's API key: --api-key, else PAGODA_API_KEY (a secret kept out of the process list)."""
    return flag or os.environ.get("PAGODA_API_KEY") or None


_warned_float16 = False


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """The compute dtype for a name. float16 on CPU computes in bfloat16 where the CPU has it natively,
    else float32: CPU fp16 matmuls are emulated (slow) and fp16 overflows where bf16 and fp32 do not."""
    global _warned_float16
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if has_native_bf16() else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype: unknown {dtype!r}; choose auto, float32, bfloat16 or float16")
    resolved = names[dtype]
    if resolved is torch.float16 and not device.startswith("cuda"):
        resolved = torch.bfloat16 if has_native_bf16() else torch.float32
        if not _warned_float16:  # the engine and a draft model both resolve it: say it once
            _warned_float16 = True
            logger.warning("dtype float16: CPUs have no fast float16 compute; using %s instead",
                           str(resolved).removeprefix("torch."))
    return resolved


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | str | None = None  # bytes; None = a share of free RAM
    kv_cache_dtype: str = "auto"  # auto (= compute dtype), int8, fp8_e4m3, fp8_e5m2
    # Share of available RAM the KV pool takes when kv_cache_memory is not given.
    memory_fraction: float = 0.25
    max_default_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)

    def pool_bytes(self, bytes_per_block: int, blocks_wanted: int) -> int:
        """KV pool size in bytes: kv_cache_memory when given; else what `blocks_wanted` blocks take (every
        sequence at its full context), capped at a share of available RAM and at max_default_bytes."""
        explicit = parse_memory(self.kv_cache_memory)
        if explicit is not None:
            if explicit <= 0:
                raise ValueError("kv_cache_memory must be positive")
            return explicit
        avail = psutil.virtual_memory().available
        cap = int(min(avail * self.memory_fraction, self.max_default_bytes))
        return min(bytes_per_block * blocks_wanted, cap)


# Engine arguments by their former names: still taken, with a DeprecationWarning.
RENAMED_ARGUMENTS = {"int4_activations": "quant_activations"}

SCHEDULING_POLICIES = ("priority", "fcfs")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None = the model's context length
    # priority: requests are served by their `priority` (lower first, as in vLLM), and a waiting request
    # takes the seat and blocks of a running one of a higher value; fcfs: the field is ignored.
    policy: str = "priority"


@dataclass
class LoRAConfig:
    """Batched multi-LoRA (pagoda/lora/): adapters of the served model, several in one batch."""
    enable_lora: bool = False
    max_loras: int = 4       # adapters resident at once (slots); least recently used idle one is replaced
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are sized by it)

    def validate(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")


SPECULATIVE_METHODS = ("ngram", "draft_model", "self", "eagle3", "mtp")
_MODEL_METHODS = ("draft_model", "eagle3")  # the methods that read `model`
_HEAD_METHODS = ("eagle3", "mtp")  # a head over the target's states (spec_decode/head_proposer.py): trees too


@dataclass
class SpeculativeConfig:
    """Speculative decoding (pagoda/spec_decode/), vLLM's key names. Built from the `--speculative-config`
    JSON object by `from_dict`; every value is checked on construction, each error naming its key."""

    method: str                                # one of SPECULATIVE_METHODS
    num_speculative_tokens: int                # k: the most tokens proposed per request per step
    prompt_lookup_min: int = 1                 # ngram: shortest suffix matched
    prompt_lookup_max: int = 4                 # ngram: longest suffix matched (tried first)
    model: str | None = None                   # draft_model: an HF folder or .gguf with the target's vocabulary;
                                               # eagle3: a head folder (spec_decode/eagle3_head.py)
    num_draft_layers: int | None = None        # self: the early-exit depth L
    adaptive: bool = True                      # pick k per request from measured acceptance and step cost
    # eagle3, mtp: a static draft tree in vLLM's form, "[(0,), (1,), (0, 0)]": each node the path of child ranks from
    # the root (rank r: the head's r-th most likely token below its parent); then num_speculative_tokens is its
    # number of nodes, as in vLLM. None: chains. Parsed and checked by core/draft_tree.TokenTree.
    speculative_token_tree: str | list | None = None
    # eagle3, mtp: the head's linears quantized as they load (int8, int4 or fp8, as the target's `quantization`;
    # the head over the draft vocabulary int8 under int4). A head's pass reads all its weights for a few rows,
    # so it costs what they weigh; its drafts are still verified by the target, so output is unchanged.
    quantization: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        """Parse the JSON object, raising ValueError that names the offending key."""
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a dict (JSON object)")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        if d.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method: {d.get('method')!r}; "
                             f"choose one of {', '.join(SPECULATIVE_METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**d)

    def __post_init__(self) -> None:
        method = self.method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method: {method!r}; choose one of {', '.join(SPECULATIVE_METHODS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_draft_layers"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config.{key} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 16 and self.speculative_token_tree is None:
            raise ValueError("speculative_config.num_speculative_tokens must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max")
        if method in _MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config.model is required for method {method!r}")
        if method not in _MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative_config.model applies to methods {', '.join(_MODEL_METHODS)}, "
                             f"not {method!r}")
        if method == "self" and self.num_draft_layers is None:
            raise ValueError("speculative_config.num_draft_layers is required for method 'self'")
        if method != "self" and self.num_draft_layers is not None:
            raise ValueError(f"speculative_config.num_draft_layers applies to method 'self', not {method!r}")
        if self.speculative_token_tree is not None:
            if method not in _HEAD_METHODS:
                raise ValueError(f"speculative_config.speculative_token_tree applies to methods "
                                 f"{', '.join(_HEAD_METHODS)}, not {method!r}")
            tree = TokenTree.parse(self.speculative_token_tree)  # raises naming the key
            if len(tree.paths) != self.num_speculative_tokens:
                raise ValueError(f"speculative_config.num_speculative_tokens ({self.num_speculative_tokens}) must be "
                                 f"the number of nodes of speculative_token_tree ({len(tree.paths)})")
        if not isinstance(self.adaptive, bool):
            raise ValueError("speculative_config.adaptive must be true or false")
        if self.quantization is not None:
            from pagoda.quantization.methods import ON_THE_FLY

            if method not in _HEAD_METHODS:
                raise ValueError(f"speculative_config.quantization applies to methods {', '.join(_HEAD_METHODS)} "
                                 f"(a draft model runs with the target's quantization), not {method!r}")
            if self.quantization not in ON_THE_FLY:
                raise ValueError(f"speculative_config.quantization: {self.quantization!r}; choose one of "
                                 f"{', '.join(ON_THE_FLY)}")


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"  # grammar library: auto (xgrammar, else llguidance), xgrammar, guidance
    # Append the text a grammar forces (JSON keys, punctuation) in one step instead of one step per token.
    jump_forward: bool = True
    # 0: grammars compile on threads of this process (trusted input: LLM's default). N: in up to N worker
    # processes, each killed when its compile runs past compile_timeout, grows past compile_memory, or is no
    # longer wanted (the server's default, structured/compile_workers.py).
    compile_workers: int = 0
    compile_timeout: float | None = None   # seconds one compile may run (worker processes only)
    compile_memory: int | str | None = None  # bytes one compile may add to its worker (worker processes only)
    cache_memory: int | str = "1GiB"       # compiled grammars kept for reuse, least recently used evicted first

    def validate(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {self.backend!r}")
        if not isinstance(self.compile_workers, int) or self.compile_workers < 0:
            raise ValueError("structured_outputs_compile_workers must be a non-negative integer")
        if self.compile_timeout is not None and not 0 < self.compile_timeout < float("inf"):
            raise ValueError("structured_outputs_compile_timeout must be a positive number of seconds")
        for name in ("compile_memory", "cache_memory"):
            value = parse_memory(getattr(self, name))
            if value is not None and value <= 0:
                raise ValueError(f"structured_outputs_{name} must be positive")


@dataclass
class PoolingConfig:
    """The pooling runner (embeddings, scores) and its dynamic batcher (engine/pooling_batcher.py): requests
    wait up to max_queue_delay_ms for others to share a forward, which takes at most max_num_seqs sequences
    and max_num_batched_tokens tokens (one longer sequence runs alone)."""

    model: str | None = None  # None: the embedded all-MiniLM-L6-v2
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's limit (sentence-transformers' max_seq_length)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_queue_delay_ms: float = 2.0
    cpus: str | None = None
    threads: int | None = None
    # A causal LM (executor/prefill_runner.py) runs on the engine's kernels and weight formats.
    kernels: str = "auto"
    quantization: str | None = None
    # A causal LM as a reranker: a pair's score is the softmax over these tokens' logits at its last position,
    # the last token's probability (Qwen3-Reranker: ["no", "yes"]; vLLM's name). One token: the sigmoid of its logit.
    classifier_from_token: list[str] | None = None

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kw: Any) -> "PoolingConfig":
        """Build from the same keyword arguments as EngineConfig; those a pooling model has no use for
        (KV cache, speculation, ...) are ignored."""
        cfg = cls(model=model, **{k: v for k, v in kw.items() if k in cls.__dataclass_fields__ and v is not None})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        resolve_dtype(self.dtype)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 <= self.max_queue_delay_ms < float("inf"):
            raise ValueError("max_queue_delay_ms must be a non-negative number of milliseconds")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.classifier_from_token is not None and len(self.classifier_from_token) not in (1, 2):
            raise ValueError("classifier_from_token names one token or two (e.g. no,yes)")
        from pagoda.cpus import resolve

        resolve(self.cpus, self.threads)


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    quantization: str | None = None  # weight quantization method (pagoda.quantization), None = as stored
    quantization_group_size: int = 128  # int4 group size (32, 64 or 128; smaller where K needs it)
    speculative_config: SpeculativeConfig | None = None
    # auto: the C++ CPU kernels' best build for this CPU; native / avx2: that build
    # (-march=native / x86-64-v3, kernels/cpu_extension.py); either is an error where it can't build or run;
    # torch: torch ops only
    kernels: str = "auto"
    # int8: quantized linears (INT4, GGUF blocks) round their activations to INT8 per block and compute with integer
    # dot products, as llama.cpp does (docs/benchmarks.md); float: weight-only, exact products of the float x
    quant_activations: str = "float"
    # auto: where several kernels can serve a linear layer's shape, time them once on this machine and keep the
    # fastest (kernels/tuning.py; cached in tuning.json beside the kernel build); off: the built-in choice.
    # PAGODA_KERNEL_TUNING sets the default (the test suite runs "off": its layouts must not depend on a timing).
    kernel_tuning: str = field(default_factory=lambda: os.environ.get("PAGODA_KERNEL_TUNING", "auto"))
    # Ranks the model is split over (Megatron-style, executor/multiproc.py): spawned on this host, or started
    # by torchrun across hosts.
    tensor_parallel_size: int = 1
    # The cores this engine runs on ("0-3,6"; default: its affinity mask) and its compute threads (default: one per
    # usable core, capped by a cgroup CPU quota, or OMP_NUM_THREADS where set): pagoda/cpus.py.
    cpus: str | None = None
    threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kw: Any) -> "EngineConfig":
        """Build from vLLM-style flat keyword arguments (dtype=, block_size=, ...)."""
        cache_keys = {"block_size", "kv_cache_memory", "enable_prefix_caching", "kv_cache_dtype"}
        sched_keys = {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}
        policy_keys = {"scheduling_policy"}
        structured_keys = {f"structured_outputs_{f}" for f in StructuredOutputsConfig.__dataclass_fields__}
        lora_keys = set(LoRAConfig.__dataclass_fields__)
        top_keys = {"tokenizer", "dtype", "device", "seed", "quantization", "speculative_config",
                    "quantization_group_size", "kernels", "quant_activations", "kernel_tuning", "tensor_parallel_size",
                    "cpus", "threads"}
        for old, new in RENAMED_ARGUMENTS.items():
            if old in kw:
                warnings.warn(f"engine argument {old!r} is now {new!r}", DeprecationWarning, stacklevel=3)
                if new in kw:
                    raise TypeError(f"engine arguments {old!r} and {new!r} name one setting: pass {new!r} only")
                kw = {new if k == old else k: v for k, v in kw.items()}
        unknown = set(kw) - cache_keys - sched_keys - policy_keys - structured_keys - lora_keys - top_keys
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        spec = kw.get("speculative_config")
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            kw = {**kw, "speculative_config": SpeculativeConfig.from_dict(spec)}
        cfg = cls(model=model, **{k: v for k, v in kw.items() if k in top_keys and v is not None})
        cfg.cache = CacheConfig(**{k: v for k, v in kw.items() if k in cache_keys and v is not None})
        cfg.scheduler = SchedulerConfig(**{k: v for k, v in kw.items() if k in sched_keys and v is not None})
        if kw.get("scheduling_policy") is not None:
            cfg.scheduler.policy = kw["scheduling_policy"]
        cfg.structured = StructuredOutputsConfig(**{k.removeprefix("structured_outputs_"): v for k, v in kw.items()
                                                    if k in structured_keys and v is not None})
        cfg.lora = LoRAConfig(**{k: v for k, v in kw.items() if k in lora_keys and v is not None})
        if cfg.cache.block_size <= 0:
            raise ValueError("block_size must be positive")
        if cfg.scheduler.max_num_seqs <= 0 or cfg.scheduler.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if cfg.scheduler.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {cfg.scheduler.policy!r}")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check every value that needs no model, so a bad one fails before weights load."""
        from pagoda.quantization.int4_format import GROUP_SIZES
        from pagoda.quantization.methods import check_method

        resolve_dtype(self.dtype, self.device)
        check_kernels(self.kernels, self.quant_activations, self.kernel_tuning)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        memory = parse_memory(self.cache.kv_cache_memory)
        if memory is not None and memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.scheduler.max_model_len is not None and self.scheduler.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        check_method(self.quantization)
        if self.quantization_group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size: int4 group size {self.quantization_group_size} not "
                             f"supported; choose one of {GROUP_SIZES}")
        self.structured.validate()
        self.lora.validate()
        if self.lora.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora runs on one rank: tensor_parallel_size must be 1")
        from pagoda.cpus import resolve

        resolve(self.cpus, self.threads)

    def kernel_policy(self) -> KernelPolicy:
        """The kernels this engine's models may use, resolved once (the C++ build is tried here)."""
        return KernelPolicy.resolve(self.kernels, self.quant_activations, self.kernel_tuning)
