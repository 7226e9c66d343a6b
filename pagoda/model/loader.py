"""Resolve a model path (HF safetensors folder or GGUF file) into config + weight iterator.

Pickle-based checkpoints (*.bin, *.pt, *.pth) are refused: unpickling runs arbitrary code.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.model.args import ModelArgs

_PICKLE_EXTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class ModelFiles:
    """A located model: its HF-style config and a way to stream its weights."""

    hf_config: dict[str, Any]
    source: str                      # the path as given (or the default model path)
    kind: str = "hf"                 # "hf" (config.json + safetensors folder) or "gguf"
    weight_files: list[str] = field(default_factory=list)  # safetensors shards, or [gguf file]
    _gguf: Any = field(default=None, repr=False)           # parsed GGUFFile for kind == "gguf"

    @property
    def folder(self) -> str:
        """Folder holding the model (tokenizer files live here for HF folders)."""
        return self.source if self.kind == "hf" else os.path.dirname(os.path.abspath(self.source))

    def iter_weights(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor converted to `dtype`); lm_head is omitted when tied."""
        if self.kind == "gguf":
            from pagoda.model.gguf_loader import iter_gguf_weights

            yield from iter_gguf_weights(self._gguf, self.hf_config, dtype)
            return
        from safetensors import safe_open

        tied = bool(self.hf_config.get("tie_word_embeddings", False))
        for path in self.weight_files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    # Buffers some exporters persist; recomputed by the model, not parameters.
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if tied and name == "lm_head.weight":
                        continue
                    t = f.get_tensor(name)
                    yield name, (t if t.dtype == dtype else t.to(dtype))


def _load_config(folder: str) -> dict[str, Any]:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"model folder {folder!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed config.json in {folder!r}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"malformed config.json in {folder!r}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed model.safetensors.index.json in {folder!r}: {e!r}") from None
        files = [os.path.join(folder, n) for n in names]
        missing = [n for n, p in zip(names, files) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"model folder {folder!r} is missing shards listed in the index: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    pickles = [n for n in sorted(os.listdir(folder)) if n.endswith(_PICKLE_EXTS)]
    if pickles:
        raise ValueError(
            f"model folder {folder!r} only has pickle checkpoints ({', '.join(pickles[:3])}); "
            "pagoda never unpickles weights (it can execute code). Convert them to safetensors, "
            "e.g. load with transformers and call save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"model folder {folder!r} has no *.safetensors weight files")


def resolve_model_files(path: str | None) -> ModelFiles:
    """Locate a model: None -> embedded default GGUF; an HF folder; or a .gguf file."""
    if path is None:
        from pagoda.model.default_model import default_model_path

        path = default_model_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path!r} (pagoda only loads local files)")

    if os.path.isdir(path):
        cfg = _load_config(path)
        ModelArgs.from_hf_config(cfg)  # validates required keys; raises ValueError naming the gap
        return ModelFiles(hf_config=cfg, source=path, kind="hf", weight_files=_safetensors_files(path))

    if path.lower().endswith(".gguf"):
        from pagoda.model.gguf_loader import GGUFFile, gguf_hf_config

        g = GGUFFile(path)
        cfg = gguf_hf_config(g)
        ModelArgs.from_hf_config(cfg)
        return ModelFiles(hf_config=cfg, source=path, kind="gguf", weight_files=[path], _gguf=g)

    if path.endswith(_PICKLE_EXTS):
        raise ValueError(f"refusing to load {path!r}: pickle checkpoints are never unpickled; "
                         "use a safetensors folder or a .gguf file")
    raise ValueError(f"unsupported model file {path!r}: pass a folder with config.json + *.safetensors, "
                     "or a .gguf file")
