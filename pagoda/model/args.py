"""ModelArgs: the architecture facts the model code needs, read from an HF config.json dict."""
from __future__ import annotations

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
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        if not archs:
            mt = cfg.get("model_type", "")
            archs = {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                     "mistral": ["MistralForCausalLM"]}.get(mt, [])
        if not archs:
            raise ValueError("config.json has neither 'architectures' nor a known 'model_type'")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            arch = archs[0]
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling here
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                hf_config=cfg,
            )
        except KeyError as e:
            raise ValueError(f"malformed config.json: missing {e.args[0]!r}") from None
