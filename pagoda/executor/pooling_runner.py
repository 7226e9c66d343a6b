"""The pooling runner: text -> token ids -> one packed forward of an encoder -> a vector (embedding models)
or a score (cross-encoders) per input. No KV cache and no scheduler steps: every input is whole in one
forward, so the paged engine (engine/engine.py) is not involved. vLLM calls this its pooling runner."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from pagoda.config import PoolingConfig, resolve_dtype
from pagoda.cpus import resolve as resolve_cpus
from pagoda.layers.pooler import PoolerConfig, pool
from pagoda.model.bert import is_encoder_config, load_encoder
from pagoda.model.default_model import default_embedding_model_path
from pagoda.model.locate import locate_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolingInput:
    """One sequence to pool: its token ids, and for a text pair the segment of each token."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


class PoolingRunner:
    """An embedding model or a cross-encoder loaded from a Hugging Face or sentence-transformers folder."""

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32, max_model_len: int | None = None) -> None:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        if not is_encoder_config(cfg):
            raise ValueError(f"{folder}: {cfg.get('architectures')} is not an encoder model; the pooling runner "
                             "serves BERT, MiniLM, RoBERTa and XLM-RoBERTa encoders and their cross-encoders")
        self.folder = folder
        self.dtype = dtype
        self.model = load_encoder(folder, dtype)
        args = self.model.args
        self.is_cross_encoder = args.head is not None
        if self.is_cross_encoder and args.num_labels != 1:
            raise ValueError(f"{folder}: a cross-encoder scores with one label; this one has {args.num_labels}")
        self.pooler = PoolerConfig.from_folder(folder, default_mode="cls")
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        limit = args.max_tokens
        st_config = os.path.join(folder, "sentence_bert_config.json")
        if os.path.isfile(st_config):  # sentence-transformers' own limit (all-MiniLM-L6-v2: 256 of 512)
            with open(st_config, encoding="utf-8") as f:
                limit = min(limit, int(json.load(f).get("max_seq_length") or limit))
        if max_model_len is not None:
            if max_model_len > args.max_tokens:
                raise ValueError(f"max_model_len {max_model_len} is above the model's {args.max_tokens} positions")
            limit = max_model_len
        self.max_model_len = limit
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.tokenizer.no_truncation()  # limits are ours to apply, and a 400 where no truncation was asked
        self.tokenizer.no_padding()

    @classmethod
    def from_config(cls, config: PoolingConfig) -> PoolingRunner:
        """Pin threads as the engine does (pagoda/cpus.py), find the model (default: the embedded
        all-MiniLM-L6-v2) and load it."""
        cores, threads = resolve_cpus(config.cpus, config.threads)
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if threads is not None:
            torch.set_num_threads(threads)
        folder = locate_model(config.model) if config.model is not None else default_embedding_model_path()
        if not os.path.isdir(folder):
            raise ValueError(f"{config.model}: a pooling model is a Hugging Face or sentence-transformers folder")
        return cls(folder, resolve_dtype(config.dtype), config.max_model_len)

    # ---- inputs ------------------------------------------------------------------------------------
    def tokenize(self, text: str, pair: str | None = None, truncate: int | None = None) -> PoolingInput:
        """A text (or a query/document pair for a cross-encoder) with the model's special tokens. `truncate`:
        keep at most that many tokens (-1: the model's limit), cutting the text's end (a pair's second text);
        without it a text over the limit is a ValueError."""
        tok = self.tokenizer
        first = tok.encode(text, add_special_tokens=False)
        second = tok.encode(pair, add_special_tokens=False) if pair is not None else None
        specials = tok.num_special_tokens_to_add(is_pair=second is not None)
        total = len(first.ids) + (len(second.ids) if second is not None else 0) + specials
        limit = self._limit(truncate)
        if total > limit:
            if truncate is None:
                raise ValueError(f"the input has {total} tokens, more than the model's max_model_len "
                                 f"{self.max_model_len} (truncate_prompt_tokens cuts it)")
            over = total - limit
            if second is not None:
                second.truncate(max(0, len(second.ids) - over))
                over = max(0, over - len(second.ids))
            if over:
                first.truncate(max(0, len(first.ids) - over))
        enc = tok.post_process(first, second, add_special_tokens=True)
        return PoolingInput(list(enc.ids), list(enc.type_ids) if second is not None else None)

    def from_token_ids(self, ids: list[int], truncate: int | None = None) -> PoolingInput:
        """Token ids as given (special tokens are the client's to add); ValueError outside the vocabulary
        or over the limit unless `truncate`."""
        if not ids:
            raise ValueError("an input has no tokens")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        limit = self._limit(truncate)
        if len(ids) > limit:
            if truncate is None:
                raise ValueError(f"the input has {len(ids)} tokens, more than the model's max_model_len "
                                 f"{self.max_model_len} (truncate_prompt_tokens cuts it)")
            ids = ids[:limit]
        return PoolingInput(list(ids))

    def _limit(self, truncate: int | None) -> int:
        if truncate is None or truncate == -1:
            return self.max_model_len
        if truncate < 1:
            raise ValueError("truncate_prompt_tokens must be -1 or a positive number of tokens")
        return min(truncate, self.max_model_len)

    # ---- the forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        """One packed forward over all `inputs`: per input, its embedding (fp32; unit length where the model
        normalizes) or, for a cross-encoder, its score (sigmoid of the logit, as sentence-transformers'
        CrossEncoder and vLLM's /score give it)."""
        if not inputs:
            return []
        cu = [0]
        for x in inputs:
            cu.append(cu[-1] + len(x.token_ids))
        ids = torch.tensor([t for x in inputs for t in x.token_ids], dtype=torch.long)
        types = torch.tensor([t for x in inputs for t in (x.token_type_ids or [0] * len(x.token_ids))],
                             dtype=torch.long)
        hidden = self.model(ids, types, cu)
        if self.is_cross_encoder:
            return list(torch.sigmoid(self.model.classify(hidden, cu).float()[:, 0]))
        vectors = pool(hidden, cu, self.pooler.mode)
        if self.pooler.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return list(vectors)
