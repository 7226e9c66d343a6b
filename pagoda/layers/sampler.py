"""Batched sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

One call samples every row of a step. Rows that share nothing still go through the same tensor ops;
only per-row seeded noise draws loop in Python (one small draw per seeded row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.fused_ops import argmax_rows
from pagoda.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step (row = one sequence that samples this step)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    output_token_ids: list[list[int]]      # for presence/frequency penalties
    prompt_token_ids: list[list[int]]      # repetition penalty covers prompt and output
    banned_token_ids: list[list[int]]      # EOS/stop ids while below min_tokens

    def __post_init__(self) -> None:
        p = self.params
        self.all_greedy = all(x.greedy for x in p)
        self.any_penalty = any(x.presence_penalty or x.frequency_penalty or x.repetition_penalty != 1.0 for x in p)
        self.any_top_k = any(x.top_k > 0 for x in p)
        self.any_top_p = any(x.top_p < 1.0 for x in p)
        self.any_min_p = any(x.min_p > 0.0 for x in p)
        self.any_logit_bias = any(x.logit_bias for x in p)
        self.max_logprobs = max((x.logprobs for x in p if x.logprobs is not None), default=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Only when some row asked for logprobs: per row, the sampled token's logprob and rank, and top-k.
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None

    def select(self, rows: list[int]) -> "SamplerOutput":
        """The output of the given rows only, in that order (itself when that is every row)."""
        if rows == list(range(len(self.token_ids))):
            return self

        def pick(values: list | None) -> list | None:
            return None if values is None else [values[r] for r in rows]
        return SamplerOutput([self.token_ids[r] for r in rows], pick(self.sampled_logprobs), pick(self.sampled_ranks),
                             pick(self.topk_ids), pick(self.topk_logprobs))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens; CTRL-style repetition penalty on all seen."""
    B, V = logits.shape
    out_counts = torch.zeros(B, V, dtype=logits.dtype)
    seen = torch.zeros(B, V, dtype=torch.bool)
    for i, (out_ids, prompt_ids) in enumerate(zip(batch.output_token_ids, batch.prompt_token_ids)):
        if out_ids:
            ids = torch.tensor(out_ids, dtype=torch.long)
            out_counts[i].index_add_(0, ids, torch.ones(len(out_ids), dtype=logits.dtype))
            seen[i, ids] = True
        if batch.params[i].repetition_penalty != 1.0 and prompt_ids:
            seen[i, torch.tensor(prompt_ids, dtype=torch.long)] = True
    rep = torch.tensor([p.repetition_penalty for p in batch.params], dtype=logits.dtype).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([p.frequency_penalty for p in batch.params], dtype=logits.dtype).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in batch.params], dtype=logits.dtype).unsqueeze(1)
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets."""
    V = logits.shape[1]
    if batch.any_top_k or batch.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if batch.any_top_k:
            k = torch.tensor([p.top_k if p.top_k > 0 else V for p in batch.params]).clamp(max=V)
            mask |= torch.arange(V).unsqueeze(0) >= k.unsqueeze(1)
        if batch.any_top_p:
            probs = sorted_logits.masked_fill(mask, _NEG_INF).softmax(dim=-1)
            top_p = torch.tensor([p.top_p for p in batch.params], dtype=probs.dtype).unsqueeze(1)
            # Keep a token if the mass before it is below top_p (the top token is always kept).
            mask |= (probs.cumsum(dim=-1) - probs) >= top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(mask, _NEG_INF))
    if batch.any_min_p:
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in batch.params], dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, _NEG_INF)
    return logits


def target_distribution(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution each row samples from: (greedy token ids, probs [B, V] or None when all rows are greedy).

    Penalties -> logit_bias -> min_tokens bans -> temperature -> top-k/top-p/min-p. Edits `logits` in place
    (bias, bans). Speculative verification calls this too, so p there is exactly what the sampler draws from."""
    if batch.any_penalty:
        logits = apply_penalties(logits, batch)
    if batch.any_logit_bias:
        for i, p in enumerate(batch.params):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype))
    for i, banned in enumerate(batch.banned_token_ids):
        if banned:
            logits[i, banned] = _NEG_INF
    greedy_ids = argmax_rows(logits)
    if batch.all_greedy:
        return greedy_ids, None
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in batch.params],
                         dtype=logits.dtype).unsqueeze(1)
    return greedy_ids, apply_top_k_top_p_min_p(logits / temps, batch).softmax(dim=-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V] in the model's dtype -> one token per row."""
        if batch.all_greedy and batch.max_logprobs < 0 and not batch.any_penalty \
                and not batch.any_logit_bias and not any(batch.banned_token_ids):
            # Plain greedy: the argmax of the logits as they are (widening bf16 to fp32 is exact).
            return sampler_output(argmax_rows(logits), None, batch.max_logprobs)
        logits = logits.float()
        # Logprobs report the model's raw distribution, before any processing (vLLM v1's default).
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
        greedy_ids, probs = target_distribution(logits, batch)
        if probs is None:
            token_ids = greedy_ids
        else:
            # Inverse CDF: one uniform per row, the first token whose cumulative probability passes it (a token
            # of zero probability never does). A row-wise cumsum is each row's own, and seeded rows draw their
            # uniform from their own generator, so they reproduce whatever else shares the batch. (One draw a
            # row: an exponential race needs one per vocabulary entry, which costs more than the forward.)
            u = torch.rand(probs.shape[0], 1)
            for i, g in enumerate(batch.generators):
                if g is not None and not batch.params[i].greedy:
                    u[i] = torch.rand(1, generator=g)
            cdf = probs.cumsum(dim=-1)
            sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
            is_greedy = torch.tensor([p.greedy for p in batch.params])
            token_ids = torch.where(is_greedy, greedy_ids, sampled)
        return sampler_output(token_ids, raw_logprobs, batch.max_logprobs)


def sampler_output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, max_logprobs: int) -> SamplerOutput:
    """Chosen tokens plus, when asked, their raw logprobs, ranks and the top-k alternatives."""
    out = SamplerOutput(token_ids=token_ids.tolist())
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))
        out.sampled_logprobs = chosen.squeeze(1).tolist()
        out.sampled_ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
        k = max_logprobs
        if k > 0:
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
            out.topk_ids = top_ids.tolist()
            out.topk_logprobs = top_vals.tolist()
    return out
