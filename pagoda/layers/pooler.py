"""Pooling: one vector per sequence from the hidden states of its tokens, as sentence-transformers computes
it (its `1_Pooling/config.json` and `Normalize` module, read from the model folder as they are)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_MODES = ("mean", "cls", "lasttoken", "max")
# sentence-transformers' flags in 1_Pooling/config.json -> our mode name.
_ST_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max"}


@dataclass(frozen=True)
class PoolerConfig:
    mode: str = "cls"
    normalize: bool = False

    @classmethod
    def from_folder(cls, folder: str, default_mode: str, default_normalize: bool = False) -> PoolerConfig:
        """The pooling a sentence-transformers folder declares in modules.json; `default_mode` and
        `default_normalize` for a plain Hugging Face folder."""
        modules_path = os.path.join(folder, "modules.json")
        if not os.path.isfile(modules_path):
            return cls(default_mode, default_normalize)
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
        mode, normalize = default_mode, False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                with open(os.path.join(folder, m.get("path", ""), "config.json"), encoding="utf-8") as f:
                    cfg = json.load(f)
                if "pooling_mode" in cfg:  # newer sentence-transformers write the name directly
                    mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(
                        cfg["pooling_mode"], cfg["pooling_mode"])
                else:
                    chosen = [name for flag, name in _ST_FLAGS.items() if cfg.get(flag)]
                    if len(chosen) != 1 or any(cfg.get(f) for f in ("pooling_mode_mean_sqrt_len_tokens",
                                                                   "pooling_mode_weightedmean_tokens")):
                        raise ValueError(f"{folder}: pooling {cfg} is not supported (one of {POOLING_MODES})")
                    mode = chosen[0]
            elif kind == "Normalize":
                normalize = True
            elif kind not in ("Transformer", ""):
                raise ValueError(f"{folder}: sentence-transformers module {m.get('type')!r} is not supported")
        if mode not in POOLING_MODES:
            raise ValueError(f"{folder}: pooling mode {mode!r} is not supported (one of {POOLING_MODES})")
        return cls(mode, normalize)


def pool(hidden: torch.Tensor, cu_seqlens: list[int], mode: str) -> torch.Tensor:
    """[B, hidden] from packed hidden states [T, hidden]; each sequence reduced on its own, in fp32, so a
    sequence's vector does not depend on its batch."""
    spans = zip(cu_seqlens[:-1], cu_seqlens[1:])
    if mode == "cls":
        return hidden[torch.tensor(cu_seqlens[:-1])].float()
    if mode == "lasttoken":
        return hidden[torch.tensor(cu_seqlens[1:]) - 1].float()
    if mode == "mean":
        return torch.stack([hidden[s:e].float().mean(0) for s, e in spans])
    if mode == "max":
        return torch.stack([hidden[s:e].float().amax(0) for s, e in spans])
    raise ValueError(f"pooling mode {mode!r} is not one of {POOLING_MODES}")


def truncate_and_normalize(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation to the first `dimensions` values, then unit length where the model normalizes
    (a truncated unit vector is no longer one)."""
    if dimensions is not None:
        vectors = vectors[..., :dimensions]
    return F.normalize(vectors, dim=-1) if normalize else vectors
