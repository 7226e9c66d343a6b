"""Score and rerank requests as pooling inputs: a cross-encoder reads each (query, document) pair in one
sequence; an embedding model embeds the texts and scores a pair by the cosine of their vectors (as vLLM's
/score does for embedding models)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.executor.pooling_runner import PoolingInput, PoolingRunner


def pair_up(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] with text_2[i]."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many "
                         "as text_2")
    return list(zip(firsts, seconds))


@dataclass
class ScoreJob:
    """The pooling inputs of a list of pairs, and how their results become one score per pair."""

    inputs: list[PoolingInput]
    num_pairs: int
    cross_encoder: bool

    @classmethod
    def build(cls, runner: PoolingRunner, pairs: list[tuple[str, str]], truncate: int | None = None) -> ScoreJob:
        if runner.is_cross_encoder:
            return cls([runner.tokenize(a, b, truncate) for a, b in pairs], len(pairs), True)
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        return cls([runner.tokenize(t, truncate=truncate) for t in texts], len(pairs), False)

    def scores(self, results: list[torch.Tensor]) -> list[float]:
        if self.cross_encoder:
            return [float(r) for r in results]
        a = torch.stack(results[:self.num_pairs])
        b = torch.stack(results[self.num_pairs:])
        return F.cosine_similarity(a, b, dim=-1).tolist()

    def prompt_token_ids(self, i: int) -> list[int]:
        if self.cross_encoder:
            return self.inputs[i].token_ids
        return self.inputs[i].token_ids + self.inputs[self.num_pairs + i].token_ids

    @property
    def num_tokens(self) -> int:
        return sum(len(x.token_ids) for x in self.inputs)
