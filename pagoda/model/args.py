"""ModelArgs: the architecture facts the model code needs, read from an HF config.json dict."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Read and check an HF config dict; a missing key or a bad value raises ValueError naming it."""
        archs = cfg.get("architectures") or []
        if not archs:
            mt = cfg.get("model_type", "")
            archs = {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                     "mistral": ["MistralForCausalLM"]}.get(mt, [])
        if not archs:
            raise ValueError("config.json has neither 'architectures' nor a known 'model_type'")
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"missing {missing[0]!r} in config.json")
        hidden = _size(cfg, "hidden_size")
        heads = _size(cfg, "num_attention_heads")
        kv_heads = _size(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"bad config value: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ValueError(f"bad config value: hidden_size ({hidden}) is not divisible by "
                             f"num_attention_heads ({heads}), and there is no head_dim")
        head_dim = _size(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise ValueError(f"bad config value: head_dim {head_dim} is odd (rotary embedding needs pairs)")
        arch = archs[0]
        try:
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling here
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            args = cls(
                architecture=arch,
                vocab_size=_size(cfg, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_size(cfg, "intermediate_size"),
                num_layers=_size(cfg, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=_size(cfg, "max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                hf_config=cfg,
            )
        except (TypeError, ValueError) as e:  # a list where a number belongs, a non-numeric string
            raise ValueError(f"bad config value ({e})") from None
        if not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
            raise ValueError(f"bad config value: rope_theta = {args.rope_theta} (must be positive)")
        if not (math.isfinite(args.rms_norm_eps) and args.rms_norm_eps >= 0):
            raise ValueError(f"bad config value: rms_norm_eps = {args.rms_norm_eps} (must be >= 0)")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ValueError(f"bad config value: rope_scaling = {rope_scaling!r} (must be an object)")
        return args


_REQUIRED = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")

# Upper bounds far beyond any model of the supported families (Llama 3.1 405B: hidden 16384, 126
# layers, vocab 128256): a config past them is corrupt, and is refused before anything it sizes is
# allocated. max_position_embeddings sizes the rotary cos/sin tables.
_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
           "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
           "head_dim": 1024, "max_position_embeddings": 1 << 20}


def _size(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """cfg[key] as a positive integer within _LIMITS; `default` when the key is absent or null."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _LIMITS[key]:
        raise ValueError(f"bad config value: {key} = {value!r} (must be an integer in 1..{_LIMITS[key]})")
    return value
