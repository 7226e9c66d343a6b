"""The offline pooling API behind `LLM(task="embed" | "score")`: embed, score and rerank with vLLM's output
shapes, run on the pooling runner in batches of the token budget (no batcher thread: the caller waits)."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from pagoda.config import PoolingConfig
from pagoda.engine.scoring import ScoreJob, pair_up
from pagoda.executor.pooling_runner import PoolingInput, PoolingRunner
from pagoda.layers.pooler import truncate_and_normalize
from pagoda.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput

POOLING_TASKS = ("embed", "score")


def check_dimensions(runner: PoolingRunner, dimensions: int | None) -> None:
    if dimensions is not None and not 1 <= dimensions <= runner.hidden_size:
        raise ValueError(f"dimensions must be in [1, {runner.hidden_size}] for this model, got {dimensions}")


def run_in_batches(runner: PoolingRunner, config: PoolingConfig, inputs: list[PoolingInput]) -> list[torch.Tensor]:
    """`inputs` in forwards of at most max_num_seqs sequences and max_num_batched_tokens tokens."""
    out: list[torch.Tensor] = []
    batch: list[PoolingInput] = []
    tokens = 0
    for x in inputs:
        if batch and (len(batch) >= config.max_num_seqs or tokens + len(x.token_ids) > config.max_num_batched_tokens):
            out += runner.run(batch)
            batch, tokens = [], 0
        batch.append(x)
        tokens += len(x.token_ids)
    return out + runner.run(batch)


class OfflinePooling:
    def __init__(self, config: PoolingConfig, task: str) -> None:
        self.config = config
        self.runner = PoolingRunner.from_config(config)
        if task == "embed" and self.runner.is_cross_encoder:
            raise ValueError(f"{config.model} is a cross-encoder: it scores text pairs (task='score'), it does "
                             "not embed")
        self._next_id = 0

    def _ids(self, n: int) -> list[str]:
        self._next_id += n
        return [str(i) for i in range(self._next_id - n, self._next_id)]

    def embed(self, prompts: str | list[int] | Seq[str | list[int]], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids)."""
        r = self.runner
        if r.is_cross_encoder:
            raise ValueError("a cross-encoder does not embed; use score()")
        check_dimensions(r, dimensions)
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        inputs = [r.tokenize(p, truncate=truncate_prompt_tokens) if isinstance(p, str)
                  else r.from_token_ids(list(p), truncate_prompt_tokens) for p in prompts]  # type: ignore[arg-type]
        vectors = run_in_batches(r, self.config, inputs)
        if dimensions is not None:
            vectors = [truncate_and_normalize(v, dimensions, r.pooler.normalize) for v in vectors]
        return [EmbeddingRequestOutput(rid, x.token_ids, EmbeddingOutput(v.tolist()))
                for rid, x, v in zip(self._ids(len(inputs)), inputs, vectors)]

    def score(self, text_1: str | list[str], text_2: str | list[str],
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one text_1 against each text_2, or pairwise; a cross-encoder's score of each pair,
        or the cosine similarity of an embedding model's vectors."""
        job = ScoreJob.build(self.runner, pair_up(text_1, text_2), truncate_prompt_tokens)
        scores = job.scores(run_in_batches(self.runner, self.config, job.inputs))
        return [ScoringRequestOutput(rid, job.prompt_token_ids(i), ScoringOutput(s))
                for i, (rid, s) in enumerate(zip(self._ids(job.num_pairs), scores))]

    def rerank(self, query: str, documents: list[str], top_n: int | None = None,
               truncate_prompt_tokens: int | None = None) -> list[dict[str, Any]]:
        """Documents by relevance to `query`, best first: [{"index", "relevance_score", "document"}]."""
        if not documents:
            return []
        scores = [o.outputs.score for o in self.score(query, documents, truncate_prompt_tokens)]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [{"index": i, "relevance_score": scores[i], "document": documents[i]} for i in order]
