"""The HF transformers baseline: `generate` over the same workload, as a user without an engine would.

Static batches of 16 in workload order, left padding, greedy. Every batch runs to its longest output
(min_new_tokens = max_new_tokens), but only the tokens each request asked for count as useful.
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagoda.bench.datasets import BenchRequest

HF_BATCH_SIZE = 16


@dataclass
class PeerResult:
    name: str
    elapsed_s: float
    num_requests: int
    useful_output_tokens: int      # what the requests asked for
    generated_tokens: int          # including the padding rows that ran to the batch's longest output

    @property
    def output_tok_s(self) -> float:
        return self.useful_output_tokens / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s}


def load_hf_model(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """An HF causal LM from a .gguf file (dequantized to `dtype`) or an HF folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Its warnings here (GGUF dtype advice, per-call generation-config notes) would swamp the report.
    hf_logging.set_verbosity_error()
    if model_path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model_path))
        # The GGUF dequantization progress bar (a bare tqdm on stderr) would swamp the report.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def _left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def _generate_batch(model: torch.nn.Module, batch: Sequence[BenchRequest], pad_id: int) -> int:
    """Generate one static batch to its longest output; return the tokens generated (all rows)."""
    ids, mask = _left_pad([r.prompt_token_ids for r in batch], pad_id)
    n = max(r.output_len for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    return int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def run_hf_peer(model_path: str, requests: Sequence[BenchRequest], dtype: torch.dtype,
                batch_size: int = HF_BATCH_SIZE) -> PeerResult:
    """Time HF `generate` over `requests` (after a short warm-up batch) and count useful tokens."""
    model = load_hf_model(model_path, dtype)
    cfg = model.config
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    _generate_batch(model, [BenchRequest(requests[0].prompt_token_ids[:8], 4)] * 2, pad_id)
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        generated += _generate_batch(model, requests[i:i + batch_size], pad_id)
    elapsed = time.perf_counter() - t0
    return PeerResult(f"hf-transformers {str(dtype).removeprefix('torch.')}", elapsed, len(requests),
                      sum(r.output_len for r in requests), generated)
