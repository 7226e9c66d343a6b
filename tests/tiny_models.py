"""Tiny random-weight HF models built from a config (importable by tests; conftest names clash)."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random-weight HF model (safetensors) to `path` and return it."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
    elif arch == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's configs do
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, **{"head_dim": 32, **common}))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**phi3_longrope(common)))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path


def phi3_longrope(common: dict) -> dict:
    """A Phi-3 config's keys: LongRoPE with short and long factors that differ, pretraining context 64 (so
    test prompts sit on either side of it), 3/4 of each head rotated (Phi-4-mini); `common` overrides them."""
    kw = {"rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
          "pad_token_id": None, **common}
    half = int(kw["hidden_size"] // kw["num_attention_heads"] * kw["partial_rotary_factor"]) // 2
    kw.setdefault("rope_scaling", {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                                   "long_factor": [1.0 + 1.5 * i for i in range(half)]})
    return kw


def build_tiny_moe(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random-weight mixture-of-experts model (safetensors): `arch` "mixtral" (8 experts of 96, top 2,
    2 layers) or "qwen3_moe" (8 experts of 64, top 2, renormalized; 3 layers, the middle one a dense MLP of 128;
    head_dim 32 apart from hidden / heads); `overrides` replace config keys."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
    torch.manual_seed(0)
    if arch == "mixtral":
        cfg = MixtralConfig(**{**common, "intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 8,
                               "rope_theta": 10000.0, **overrides})
        model = MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
                                "num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True,
                                "head_dim": 32, "rope_theta": 1000000.0, **overrides})
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path
