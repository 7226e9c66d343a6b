"""The pooling runner: text -> token ids -> one packed forward -> a vector (embedding models) or a score
(cross-encoders, decoder rerankers) per input. An encoder runs as model/bert.py; a causal LM as the engine's
model, prefill only (executor/prefill_runner.py). No scheduler steps: every input is whole in one forward,
and no KV outlives it. vLLM calls this its pooling runner."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from pagoda.config import PoolingConfig, resolve_dtype
from pagoda.cpus import resolve as resolve_cpus
from pagoda.executor.prefill_runner import PrefillModel, is_causal_lm
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.pooler import PoolerConfig, pool
from pagoda.model.bert import BertEncoder, is_encoder_config, load_encoder
from pagoda.model.default_model import default_embedding_model_path
from pagoda.model.locate import locate_model
from pagoda.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolingInput:
    """One sequence to pool: its token ids, and for a text pair the segment of each token."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None


class PoolingRunner:
    """An embedding model or a cross-encoder loaded from a Hugging Face or sentence-transformers folder: a
    BERT-family encoder (model/bert.py), or a causal LM the engine loads (executor/prefill_runner.py), pooled
    at its last token (or as its sentence-transformers folder says), or scoring by the logits of
    `classifier_from_token`."""

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
                 classifier_from_token: list[str] | None = None, kernels: str = "auto",
                 quantization: str | None = None) -> None:
        self.folder = folder
        self.dtype = dtype
        if os.path.isdir(folder) and is_encoder_config(_read_config(folder)):
            if classifier_from_token is not None:
                raise ValueError(f"{folder}: classifier_from_token scores with a causal LM's logits; this is an "
                                 "encoder")
            self._load_encoder(folder, dtype, max_model_len, kernels)
        elif is_causal_lm(folder):
            self._load_causal_lm(folder, dtype, max_model_len, classifier_from_token, kernels, quantization)
        else:
            raise ValueError(f"{folder}: {_read_config(folder).get('architectures')} is neither an encoder (BERT, "
                             "MiniLM, RoBERTa, XLM-RoBERTa, MPNet and their cross-encoders) nor a causal LM "
                             "Pagoda loads")
        self.tokenizer.no_truncation()  # limits are ours to apply, and a 400 where no truncation was asked
        self.tokenizer.no_padding()

    def _load_encoder(self, folder: str, dtype: torch.dtype, max_model_len: int | None, kernels: str) -> None:
        model = load_encoder(folder, dtype, KernelPolicy.resolve(kernels))
        self.model: BertEncoder | PrefillModel = model
        args = model.args
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
        self.max_model_len = _checked_limit(limit, max_model_len, args.max_tokens)
        self.tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))

    def _load_causal_lm(self, path: str, dtype: torch.dtype, max_model_len: int | None,
                        classifier_from_token: list[str] | None, kernels: str, quantization: str | None) -> None:
        model = PrefillModel(path, dtype, kernels, quantization, max_model_len)
        self.model = model
        self.tokenizer = load_tokenizer(model.files).backend
        self.is_cross_encoder = classifier_from_token is not None
        if classifier_from_token is not None:
            model.classifier_token_ids = [self._token_id(t) for t in classifier_from_token]
        # Qwen3-Embedding's pooling: the last token (its tokenizer appends <|endoftext|>), unit length.
        self.pooler = PoolerConfig.from_folder(path, default_mode="lasttoken", default_normalize=True) \
            if os.path.isdir(path) else PoolerConfig("lasttoken", True)
        self.hidden_size = model.args.hidden_size
        self.vocab_size = model.args.vocab_size
        self.max_model_len = _checked_limit(model.max_tokens, max_model_len, model.args.max_position_embeddings)

    def _token_id(self, token: str) -> int:
        """A token by its vocabulary entry ("yes"), else a text that encodes to one token."""
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            ids = self.tokenizer.encode(token, add_special_tokens=False).ids
            if len(ids) != 1:
                raise ValueError(f"classifier_from_token: {token!r} is not one token of this model's vocabulary")
            tid = ids[0]
        return tid

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
        if not os.path.isdir(folder) and not is_causal_lm(folder):
            raise ValueError(f"{config.model}: a pooling model is a Hugging Face or sentence-transformers folder, "
                             "or a causal LM's .gguf file")
        return cls(folder, resolve_dtype(config.dtype), config.max_model_len, config.classifier_from_token,
                   config.kernels, config.quantization)

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


def _read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _checked_limit(limit: int, asked: int | None, positions: int) -> int:
    """The longest input served: `asked` (max_model_len) where given, within the model's `positions`."""
    if asked is None:
        return limit
    if asked > positions:
        raise ValueError(f"max_model_len {asked} is above the model's {positions} positions")
    return asked
