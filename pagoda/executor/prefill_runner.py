"""A causal LM as a pooling model: a prefill-only forward over packed sequences that returns the final hidden
states (for last-token or mean pooling: Qwen3-Embedding and the like), or the logits of chosen tokens at each
sequence's last position (a Qwen3-Reranker-style score). No sampling and no scheduler.

The model, its weight formats and kernels are the engine's own (executor/model_runner.py builds and loads
them). Its attention is the paged one, so the forward writes a throwaway KV: every sequence starts at
position 0 in blocks of its own, and the next forward overwrites them.
"""
from __future__ import annotations

import json
import os

import torch

from pagoda.config import EngineConfig
from pagoda.executor.model_runner import FlatBatch, ModelRunner
from pagoda.model.args import ModelArgs
from pagoda.model.loader import (
    ModelFiles,
    _safetensors_files,
    check_checkpoint,
    read_safetensors_header,
    resolve_model_files,
)
from pagoda.model.registry import model_class


def _embedding_files(path: str) -> ModelFiles:
    """The model at `path`, read as a causal LM. An embedding checkpoint saved from the base model (Qwen3Model:
    `architectures` names it, and there is no lm_head) loads as its causal LM with the head tied to the
    embedding, a head that hidden-state pooling never reads."""
    if not os.path.isdir(path):
        return resolve_model_files(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    archs = list(cfg.get("architectures") or [])
    base = [a for a in archs if a.endswith("Model")]
    if base:
        cfg["architectures"] = [a.removesuffix("Model") + "ForCausalLM" for a in base]
    weights = _safetensors_files(path)
    headless = not any("lm_head.weight" in read_safetensors_header(w) for w in weights)
    if not base and not (headless and not cfg.get("tie_word_embeddings", False)):
        return resolve_model_files(path)
    if headless:
        cfg["tie_word_embeddings"] = True
    files = ModelFiles(hf_config=cfg, source=path, kind="hf", weight_files=weights)
    check_checkpoint(files, ModelArgs.from_hf_config(cfg))
    return files


def is_causal_lm(path: str) -> bool:
    """Whether `path` (a folder or a .gguf file) holds a model the engine's model registry builds."""
    if not os.path.isdir(path):
        return path.lower().endswith(".gguf")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    archs = [a.removesuffix("Model") + "ForCausalLM" if a.endswith("Model") else a
             for a in cfg.get("architectures") or []]
    try:
        model_class(ModelArgs.from_hf_config({**cfg, "architectures": archs} if archs else cfg))
    except ValueError:
        return False
    return True


class PrefillModel:
    """A causal LM's forward for pooling, with the encoder's interface (model/bert.py BertEncoder): the hidden
    states of packed sequences, and a score per sequence where `classifier_token_ids` are set."""

    def __init__(self, path: str, dtype: torch.dtype, kernels: str = "auto", quantization: str | None = None,
                 max_model_len: int | None = None) -> None:
        self.files = _embedding_files(path)
        self.args = ModelArgs.from_hf_config(self.files.hf_config)
        self.max_tokens = min(max_model_len or self.args.max_position_embeddings, self.args.max_position_embeddings)
        config = EngineConfig.from_kwargs(path, dtype=str(dtype).removeprefix("torch."), kernels=kernels,
                                          quantization=quantization, max_model_len=self.max_tokens)
        self.runner = ModelRunner(config, self.files, self.args, dtype, config.kernel_policy())
        self.block_size = config.cache.block_size
        self.num_blocks = 0
        # (token ids to score by): 2: softmax over their logits, the second's probability; 1: its logit's sigmoid.
        self.classifier_token_ids: list[int] | None = None

    def __call__(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Final hidden states [T, hidden] (after the last norm) of the packed sequences `input_ids`; segment
        ids mean nothing to a causal LM and are ignored."""
        bs = self.block_size
        batch = FlatBatch(bs)
        first_block = 0
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            n_blocks = -(-(e - s) // bs)
            batch.add(input_ids[s:e].tolist(), 0, list(range(first_block, first_block + n_blocks)))
            first_block += n_blocks
        if first_block > self.num_blocks:  # the pool grows to the largest batch seen, and is reused
            self.runner.allocate_kv_cache(first_block)
            self.num_blocks = first_block
        dev = self.runner.device
        return self.runner.model(input_ids.to(dev), torch.tensor(batch.positions, device=dev), batch.metadata(dev))

    def classify(self, hidden: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """One logit per sequence [B, 1] whose sigmoid is its score: with tokens (no, yes), logit(yes) -
        logit(no), as sigmoid(y - n) is softmax([n, y])'s second entry."""
        assert self.classifier_token_ids is not None
        logits = self.runner.model.compute_logits(hidden[torch.tensor(cu_seqlens[1:]) - 1]).float()
        chosen = logits[:, self.classifier_token_ids]
        return chosen[:, -1:] - chosen[:, :1] if chosen.shape[1] == 2 else chosen
