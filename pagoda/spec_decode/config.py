"""SpeculativeConfig: the parsed and validated `speculative_config` dict (vLLM's key names)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "self", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that read `model`


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int                # k: the most tokens proposed per request per step
    prompt_lookup_min: int = 1                 # ngram: shortest suffix matched
    prompt_lookup_max: int = 4                 # ngram: longest suffix matched (tried first)
    model: str | None = None                   # draft_model: an HF folder or .gguf with the target's vocabulary;
                                               # eagle3: a head folder (spec_decode/eagle3_head.py)
    num_draft_layers: int | None = None        # self: the early-exit depth L
    adaptive: bool = True                      # pick k per request from measured acceptance and step cost

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        """Parse, raising ValueError that names the offending key."""
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a dict (JSON object)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        method = d.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: {method!r}; choose one of {', '.join(METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_draft_layers"):
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config.{key} must be a positive integer, got {v!r}")
        cfg = cls(**d)
        if cfg.num_speculative_tokens > 16:
            raise ValueError("speculative_config.num_speculative_tokens must be at most 16")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must not exceed prompt_lookup_max")
        if method in MODEL_METHODS and not cfg.model:
            raise ValueError(f"speculative_config.model is required for method {method!r}")
        if method not in MODEL_METHODS and cfg.model is not None:
            raise ValueError(f"speculative_config.model applies to methods {', '.join(MODEL_METHODS)}, "
                             f"not {method!r}")
        if method == "self" and cfg.num_draft_layers is None:
            raise ValueError("speculative_config.num_draft_layers is required for method 'self'")
        if method != "self" and cfg.num_draft_layers is not None:
            raise ValueError(f"speculative_config.num_draft_layers applies to method 'self', not {method!r}")
        if not isinstance(cfg.adaptive, bool):
            raise ValueError("speculative_config.adaptive must be true or false")
        return cfg
